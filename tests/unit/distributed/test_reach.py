"""Where the workers reach the training process: given, TF_CONFIG's chief or client task, or the route to a worker."""

import pytest

from tfpipe.distributed import reach


def test_an_address_given_is_used_and_a_host_alone_gets_a_free_port():
    assert reach.client_address(["10.0.0.2:2222"], "10.0.0.1:4000") == "10.0.0.1:4000"
    host, port = reach.client_address(["10.0.0.2:2222"], "10.0.0.1").split(":")
    assert host == "10.0.0.1" and 0 < int(port) < 65536
    assert reach.client_address(["[fd00::2]:2222"], "[fd00::1]:4000") == "[fd00::1]:4000"
    with pytest.raises(ValueError, match=r"client_address must be 'host' or 'host:port', got ''"):
        reach.client_address(["10.0.0.2:2222"], "")


def test_tf_configs_chief_or_client_task_is_this_process_at_its_address():
    config = {"cluster": {"worker": ["10.0.0.2:2222"], "chief": ["10.0.0.1:2223"]}, "task": {"type": "chief"}}
    assert reach.client_address(["10.0.0.2:2222"], None, config) == "10.0.0.1:2223"
    config = {
        "cluster": {"worker": ["10.0.0.2:2222"], "client": ["a:1", "b:2"]},
        "task": {"type": "client", "index": 1},
    }
    assert reach.client_address(["10.0.0.2:2222"], None, config) == "b:2"
    # a worker's own TF_CONFIG (task type worker) says nothing about this process
    worker = {"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}
    assert reach.client_address(["127.0.0.1:2222"], None, worker) is None


def test_workers_on_this_host_leave_tensorflow_its_own_localhost():
    assert reach.client_address(["localhost:2222", "127.0.0.1:2223"]) is None
    assert reach.is_loopback("localhost") and reach.is_loopback("127.0.0.5") and reach.is_loopback("::1")
    assert not reach.is_loopback("10.0.0.2")


def test_the_route_to_a_worker_gives_this_hosts_address_on_it():
    assert reach.route_to("127.0.0.1:2222") == "127.0.0.1"  # nothing is sent: a UDP socket only picks its source


def test_the_cluster_this_process_joins_replaces_its_chief_or_client_job_with_its_own():
    cluster = {"worker": ["w0:1", "w1:1"], "chief": ["c:1"]}
    assert reach.with_client(cluster, "10.0.0.1:5") == {"worker": ["w0:1", "w1:1"], "localhost": ["10.0.0.1:5"]}
    assert reach.with_client(cluster, None) == {"worker": ["w0:1", "w1:1"]}
