"""The torch side of benchmarks/benchmark_peers.py: one process per pipeline stage, driven over stdin.

Started by ``TorchPeers`` (never imported by tfpipe or by the TensorFlow process) as
``python benchmarks/peers_torch.py RANK WORLD PORT``. Every process runs with one intra-op and one
inter-op thread and joins a gloo process group on 127.0.0.1:PORT. Each reads one JSON command
per line on stdin and answers with one line on stdout that starts with ``@@`` (anything else
there is torch's own output and is ignored):

- ``{"cmd": "setup", "spec": {...}}``: build the layers of ``spec`` (the same widths, shapes and
  initial-weight scheme as the Keras side, or the Keras weights from the .npz ``spec["weights"]``)
  and the batch from the .npz ``spec["data"]``; at ``k`` > 1, this rank's ``PipelineStage`` of
  ``balance[stage]`` layers for every stage that ``placement`` puts on it (one, or v for the schedules that
  share devices) with ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble``,
  ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS`` or ``ScheduleZBVZeroBubble`` over ``m`` micro-batches.
  At ``k`` = 1 rank 0 holds the whole
  model (the reference: plain forward, backward and step; at ``m`` > 1 the micro-batches' forwards and backwards
  one after the other, then one step) and the others wait.
- ``{"cmd": "run", "steps": N, "warmup": W}``: W untimed steps, then N timed ones; answers the
  N step times in seconds (rank 0's are the ones reported) and, on the last stage, each step's loss.
- ``{"cmd": "exit"}``.

One timed pipelined step: ``schedule.step`` (rank 0 feeds the batch, the last stage the targets),
``optimizer.step()``, ``optimizer.zero_grad()``, then an ``all_reduce`` of one scalar over every
stage, so that rank 0's clock stops only when every stage has applied its update.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F  # noqa: N812

SCHEDULES = (
    "gpipe", "1f1b", "zero_bubble", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev"
)  # fmt: skip


class Block(nn.Module):
    """Pre-norm Transformer block as models/transformer.py's ``TransformerBlock``: causal attention, then a GELU MLP."""

    def __init__(self, dim: int, hidden: int, heads: int, seq_len: int):
        """Layers of the same shapes as the Keras block (LayerNorm eps 1e-5, biases everywhere)."""
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.register_buffer("mask", torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + attention(norm1(x)), then + down(gelu(up(norm2(x))))."""
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=self.mask, need_weights=False, is_causal=True)[0]
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def make_layers(spec: dict[str, Any]) -> list[nn.Module]:
    """One module per Keras layer of ``spec``: Linear + tanh for an MLP, ``Block`` for a Transformer."""
    if spec["kind"] == "mlp":
        return [nn.Sequential(nn.Linear(spec["width"], spec["width"]), nn.Tanh()) for _ in range(spec["layers"])]
    return [Block(spec["width"], spec["hidden"], spec["heads"], spec["seq_len"]) for _ in range(spec["layers"])]


def init_like_keras(layers: list[nn.Module]) -> None:
    """Glorot-uniform kernels and zero biases, as Keras' defaults (LayerNorm stays 1 and 0)."""
    for layer in layers:
        for name, param in layer.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() == 2 and not name.endswith("in_proj_weight"):
                nn.init.xavier_uniform_(param)
            elif param.dim() == 2:  # query, key and value kernels: each its own dim x dim Glorot matrix
                for part in param.data.chunk(3):
                    nn.init.xavier_uniform_(part)


def load_keras_weights(layers: list[nn.Module], arrays: Any, offset: int) -> None:
    """Copy the Keras weights of layers offset, offset+1, ... (``benchmark_peers.keras_weights``' keys) into ``layers``.

    Dense kernels (in, out) become Linear weights (out, in); the attention's query/key/value kernels
    (dim, heads, head_dim) are flattened and stacked into ``in_proj_weight``, its output kernel
    (heads, head_dim, dim) into ``out_proj``.
    """

    def get(i: int, name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arrays[f"{offset + i}/{name}"], dtype=np.float32))

    with torch.no_grad():
        for i, layer in enumerate(layers):
            if isinstance(layer, nn.Sequential):
                layer[0].weight.copy_(get(i, "kernel").T)
                layer[0].bias.copy_(get(i, "bias"))
                continue
            for norm in ("norm1", "norm2"):
                getattr(layer, norm).weight.copy_(get(i, f"{norm}/gamma"))
                getattr(layer, norm).bias.copy_(get(i, f"{norm}/beta"))
            for dense in ("up", "down"):
                getattr(layer, dense).weight.copy_(get(i, f"{dense}/kernel").T)
                getattr(layer, dense).bias.copy_(get(i, f"{dense}/bias"))
            attention, dim = layer.attention, layer.up.in_features
            qkv = [get(i, f"attention/{p}/kernel").reshape(dim, dim).T for p in ("query", "key", "value")]
            attention.in_proj_weight.copy_(torch.cat(qkv))
            biases = [get(i, f"attention/{p}/bias").reshape(dim) for p in ("query", "key", "value")]
            attention.in_proj_bias.copy_(torch.cat(biases))
            attention.out_proj.weight.copy_(get(i, "attention/output/kernel").reshape(dim, dim).T)
            attention.out_proj.bias.copy_(get(i, "attention/output/bias"))


def batch(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch (x, y) that the Keras side trains on, from the .npz ``spec["data"]``."""
    with np.load(spec["data"]) as arrays:
        return torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])


class Peer:
    """This rank's part of one configuration: its layers, optimizer, schedule (k > 1) and data."""

    def __init__(self, spec: dict[str, Any], rank: int, world: int):
        """Build what ``spec`` asks of this rank; at k=1 only rank 0 holds anything."""
        torch.manual_seed(spec.get("seed", 0))
        self.rank, self.k, self.spec = rank, spec["k"], spec
        self.active = self.k > 1 or rank == 0
        if not self.active:
            return
        if self.k > 1 and self.k != world:
            raise ValueError(f"k={self.k} cells need {self.k} processes, not {world}")
        layers = make_layers(spec)
        init_like_keras(layers)
        balance = spec["balance"] if self.k > 1 else [len(layers)]
        placement = spec.get("placement", list(range(self.k))) if self.k > 1 else [0]
        self.stage_ids = [s for s in range(len(balance)) if placement[s] == rank]
        modules = []
        for s in self.stage_ids:
            start = sum(balance[:s])
            mine = layers[start : start + balance[s]]
            if spec.get("weights"):  # --check: the Keras side's initial weights
                with np.load(spec["weights"]) as arrays:
                    load_keras_weights(mine, arrays, start)
            modules.append(nn.Sequential(*mine))
        self.module = modules[0]
        self.x, self.y = batch(spec)
        self.loss_fn = nn.MSELoss()
        self.optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=spec.get("lr", 1e-3))
        self.flag = torch.zeros(())
        self.first, self.last = 0 in self.stage_ids, len(balance) - 1 in self.stage_ids
        if self.k > 1:
            self.schedule = make_schedule(modules, self.stage_ids, len(balance), spec["m"], spec["schedule"],
                                          self.loss_fn)  # fmt: skip

    def step(self, losses: list[float] | None) -> None:
        """One training step: forward, backward and SGD (pipelined at k > 1, then one all_reduce)."""
        if self.k == 1:  # M micro-batches one after the other, their gradients summed, then one step
            m = self.spec.get("m", 1)
            for x, y in zip(self.x.chunk(m), self.y.chunk(m)):
                loss = self.loss_fn(self.module(x), y) / m
                loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            if losses is not None:
                losses.append(loss.item())
            return
        mine: list[torch.Tensor] = []
        if self.first and self.last:  # a V: the first and the last stage on rank 0
            self.schedule.step(self.x, target=self.y, losses=mine)
        elif self.first:
            self.schedule.step(self.x)
        elif self.last:
            self.schedule.step(target=self.y, losses=mine)
        else:
            self.schedule.step()
        self.optimizer.step()
        self.optimizer.zero_grad()
        dist.all_reduce(self.flag)
        if losses is not None and mine:
            losses.append(float(torch.stack(mine).detach().mean()))

    def run(self, steps: int, warmup: int, with_losses: bool) -> dict[str, Any]:
        """``warmup`` untimed steps, then ``steps`` timed ones: their seconds and (last stage) losses."""
        if not self.active:
            return {"times": []}
        times: list[float] = []
        losses: list[float] | None = [] if with_losses else None
        for i in range(warmup + steps):
            began = time.perf_counter()
            self.step(losses)
            if i >= warmup:
                times.append(time.perf_counter() - began)
        return {"times": times, "losses": losses or []}


def make_schedule(modules: list[nn.Module], stage_ids: list[int], stages: int, m: int, name: str, loss_fn: nn.Module):
    """This rank's ``PipelineStage`` of each of ``modules`` (stages ``stage_ids`` of ``stages``) under torch's
    schedule ``name`` over ``m`` micro-batches."""
    from torch.distributed import pipelining as pp

    made = [pp.PipelineStage(mod, s, stages, torch.device("cpu")) for mod, s in zip(modules, stage_ids)]
    if name == "gpipe":
        return pp.ScheduleGPipe(made[0], m, loss_fn=loss_fn)
    if name == "1f1b":
        return pp.Schedule1F1B(made[0], m, loss_fn=loss_fn)
    multi = {
        "zero_bubble": pp.ScheduleInterleavedZeroBubble,  # one stage per rank: ZB-H1's order
        "interleaved_zero_bubble": pp.ScheduleInterleavedZeroBubble,
        "interleaved_1f1b": pp.ScheduleInterleaved1F1B,
        "looped_bfs": pp.ScheduleLoopedBFS,
        "zbv": pp.ScheduleZBVZeroBubble,
        "dualpipev": getattr(pp, "ScheduleDualPipeV", None),  # torch 2.8 on
    }
    if name == "dualpipev" and multi[name] is None:
        raise ValueError(f"torch {torch.__version__} has no ScheduleDualPipeV (torch 2.8 on): install a newer torch")
    if name not in multi:
        raise ValueError(f"unknown torch schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    return multi[name](made, m, loss_fn=loss_fn)


def answer(reply: dict[str, Any]) -> None:
    """One protocol line on stdout."""
    sys.stdout.write("@@" + json.dumps(reply) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    """Join the gloo group as ``argv``'s rank and serve commands until ``exit`` or end of input."""
    rank, world, port = (int(a) for a in argv[1:4])
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.set_flush_denormal(True)  # as TensorFlow's CPU kernels do
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    peer: Peer | None = None
    answer({"ready": rank})
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["cmd"] == "exit":
                break
            if command["cmd"] == "setup":
                peer = None
                peer = Peer(command["spec"], rank, world)
                answer({"ok": True})
            elif command["cmd"] == "run":
                assert peer is not None, "run before setup"
                answer(peer.run(command["steps"], command["warmup"], command.get("losses", False)))
        except Exception as err:  # noqa: BLE001 - the driver reports it with the rank
            answer({"error": f"{type(err).__name__}: {err}"})
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv)
