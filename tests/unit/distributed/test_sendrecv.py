"""Explicit transfers' endpoints: found once per connection, not at every train_on_batch call."""

from tfpipe import _compat
from tfpipe.distributed import sendrecv

W0, W1 = "/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"
FULL0, FULL1 = "/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"


def test_endpoints_are_found_once_per_connection_and_again_after_a_new_one(monkeypatch):
    found = []

    def inserted_sends(function, x):  # what TensorFlow's partitioned graph says: one send, its incarnation
        found.append(len(found))
        return [(FULL0, FULL1, 100 + len(found))]

    monkeypatch.setattr(_compat, "inserted_sends", inserted_sends)
    sendrecv.forget()
    for _ in range(3):  # three *_on_batch calls under one connection: one search
        sendrecv.discover([(W0, W1), (W0, W0)])
    assert len(found) == 1 and sendrecv.known(W0, W1) and not sendrecv.known(W0, W0)
    sendrecv.forget()  # connected anew (a restarted worker has a new incarnation)
    sendrecv.discover([(W0, W1)])
    assert len(found) == 2 and sendrecv._ENDPOINTS[(W0, W1)] == (FULL0, FULL1, 102)
    monkeypatch.setattr(_compat, "server_def_bytes", lambda: b"another cluster")  # a user's own connect
    sendrecv.discover([(W0, W1)])
    assert len(found) == 3
