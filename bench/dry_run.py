"""A GPU dry run at full model size that allocates nothing: one expert-parallel rank of a layout,
built in bf16 on the `meta` device, through what a served step runs.

    python -m bench.gpu --dry-run --model mixtral-8x7b --gpus 8 --batch 64 --context 2048

The `meta` device stands in for the GPU: tensors have shapes, dtypes and a device but no data,
so a model of any size is built and run at no memory cost. It checks three things:

- device following: a tensor made without the configured device lands on the CPU, and meta and
  CPU tensors do not mix (torch raises); inside a decode or verify pass, any op that makes a CPU
  tensor fails the run even where torch would let it through (a CPU index into a device tensor);
- dtypes: every matmul's operands share a dtype (meta does not check it, a GPU does); weights
  and the KV cache are bf16, the logits handed to the sampler fp32;
- host syncs: every read of device data on the host (`item`, `bool`, `tolist`, `.cpu()`, and
  ops whose output size depends on the data, such as `nonzero`) is counted. A decode or verify
  pass on the padded all-to-all (model_shards/all_to_all.py) must have none besides the one
  hand-off of its logits to the sampler.
- compiled: decode and verify as the engine runs them compiled (model_shards/compiled_step.py:
  one graph on one GPU; per-layer graphs around the all-to-all on a rank of several), traced by
  dynamo, each graph run op by op under the same audit: a graph break or a read fails the run.

The rank holds its experts of the contiguous placement, loaded by `load_checkpoint` from a fake
checkpoint index (the layout's per-expert tensor names, shapes and dtypes; the safetensors
reader is the stub, the loader's code is the real one). Its KV cache is one PagedKVCache
reserved up front by the ModelRunner; the collectives run on torch's `fake` process group of
`gpus` ranks (they move nothing). A step then runs as served: prefill, a decode step, a verify
pass of k + 1 tokens a row, each handing its logits to the Sampler on the host.

Prefill keeps its data-dependent steps (the exact all-to-all plans its routes on the host).
This dry run answers those reads with a fixed routing: token t goes to experts t*K .. t*K+K-1
(mod E), the same on every rank, so a rank receives from each peer what it sends to itself;
the hand-off's logits are zeros. The GPU path's device choices are taken on `meta`: the padded
all-to-all, and torch's grouped GEMM where a compute-capability 9.x GPU has it
(`experts_grouped_on_gpu`).

Memory per GPU (weights, the KV cache at the budget, the most bytes of intermediates any pass
holds) is compared with `bench.scale_model.step`'s prediction for the same layout.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from bench.fake_checkpoint import DTYPE, load_rank
from bench.scale_model import HARDWARE, Layout, Shape, step
from model_shards.all_to_all import AllToAllDispatch
from model_shards.compiled_step import CompiledShardStep, CompiledStep
from model_shards.config import ModelConfig
from model_shards.moe import LocalDispatch, LocalExperts
from moeserve.engine.model_runner import ModelRunner, Row
from moeserve.sampler import Sampler
from moeserve.sampling_params import SamplingParams
from router_service.dispatch_plan import build_dispatch_plan
from router_service.placement import contiguous_placement

SHAPES = Path(__file__).resolve().parent / "shapes"
aten = torch.ops.aten
# ops whose output size is the data's: a GPU copies a count to the host to size them
DATA_DEPENDENT = {aten.nonzero, aten.masked_select, aten.bincount, aten._unique2, aten.unique_consecutive,
                  aten.unique_dim, aten.repeat_interleave}
READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default}
MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten._grouped_mm.default,
           aten.linear.default, aten.matmul.default}
COPIES = (aten._to_copy, aten.to)
OWN_CODE = ("model_shards", "moeserve", "router_service")


class DryRunError(AssertionError):
    """A device, dtype or host-sync defect found by the dry run; the message says where."""


def _caller() -> str:
    """The innermost frame of the project's own code (where the defect is)."""
    for frame in reversed(traceback.extract_stack()):
        if any(f"/{pkg}/" in frame.filename for pkg in OWN_CODE):
            return f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno} {frame.line}"
    return "outside the project's code"


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a `to` / `_to_copy` call's target device is the CPU."""
    device = kwargs.get("device") or next((a for a in args if isinstance(a, (torch.device, str))), None)
    return device is not None and torch.device(device).type == "cpu"


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class PassAudit(TorchDispatchMode):
    """Watches every op of one pass: host reads (answered by `answer`, else a defect), tensors made
    on the CPU (`strict`: a defect), matmul dtypes, and the peak bytes of live intermediates."""

    def __init__(self, name: str, strict: bool, answer) -> None:
        super().__init__()
        self.name, self.strict, self.answer = name, strict, answer
        self.syncs: list[str] = []
        self.handoffs = 0
        self.live = self.peak = 0

    def _defect(self, what: str) -> None:
        raise DryRunError(f"{self.name}: {what} at {_caller()}")

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        on_meta = any(t.device.type == "meta" for t in inputs)
        if func in MATMULS and len({t.dtype for t in inputs if t.is_floating_point()}) > 1:
            self._defect(f"{func} mixes dtypes {sorted(str(t.dtype) for t in inputs)}")
        to_host = func.overloadpacket in COPIES and _to_cpu(args[1:], kwargs)
        sized_by_data = func.overloadpacket in DATA_DEPENDENT and kwargs.get("output_size") is None
        if on_meta and (func in READS or sized_by_data or to_host):
            value = self.answer(func, args[0]) if self.answer is not None else None
            if getattr(value, "is_handoff", False):
                self.handoffs += 1
                return value
            self.syncs.append(f"{func} at {_caller()}")
            if value is None:
                self._defect(f"host sync ({func})")
            return value
        out = func(*args, **kwargs)
        seen = {t.untyped_storage()._cdata for t in inputs}  # views and in-place results are no new memory
        for t in _tensors(out):
            if t.device.type == "cpu" and self.strict:
                self._defect(f"{func} made a tensor on the CPU")
            if t.device.type == "meta" and t.untyped_storage()._cdata not in seen:
                seen.add(t.untyped_storage()._cdata)
                nbytes = t.numel() * t.element_size()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, nbytes)
        return out


class _Logits(torch.Tensor):
    """Stand-in logits on the host (zeros), marked as the pass's hand-off to the sampler."""

    is_handoff = True


def handoff(vocab: int, fixed: FixedRouting | None = None):
    """The host-read answer of a pass: the logits [B, V] / [B, T, V] fp32 (zeros) reach the
    sampler; with `fixed`, the exact all-to-all's reads get the fixed routing; nothing else."""

    def answer(func, t: torch.Tensor):
        if func.overloadpacket in COPIES and t.dtype == torch.float32 and t.shape[-1] == vocab:
            return torch.zeros(t.shape).as_subclass(_Logits)
        return fixed(func, t) if fixed is not None else None

    return answer


class FixedRouting:
    """The exact all-to-all's host reads in a prefill, per MoE layer: the router's expert ids
    [N, K] (token t to experts t*K + j mod E), then the rows each peer sends to this rank's
    slots [W, S] (what this rank sends itself: every rank routes alike)."""

    def __init__(self, placement, rank: int) -> None:
        self.placement, self.rank = placement, rank
        self.received: torch.Tensor | None = None

    def __call__(self, func, t: torch.Tensor) -> torch.Tensor | None:
        if func.overloadpacket not in COPIES or t.dtype != torch.long or t.dim() != 2:
            return None
        if self.received is None:
            n, k = t.shape
            ids = (torch.arange(n * k) % self.placement.num_experts).view(n, k)  # [N, K]
            sent = build_dispatch_plan(ids, self.placement).slot_counts  # [W, S]
            self.received = sent[self.rank].expand_as(sent).clone()
            return ids
        received, self.received = self.received, None
        return received


def experts_grouped_on_gpu(x: torch.Tensor, w: torch.Tensor) -> bool:
    """`grouped_mm_supported` as on a compute-capability 9.x GPU, for `meta` tensors standing in
    for it: bf16 operands whose rows are 16-byte aligned."""
    return x.dtype == w.dtype == torch.bfloat16 and all(s * x.element_size() % 16 == 0 for s in w.shape[-2:])


class AuditedGraphs:
    """A torch.compile backend whose graphs run op by op under the pass's PassAudit. (Dynamo
    does not compile while a dispatch mode is active, so the audit starts inside each graph:
    the host code around a compiled call, which reads no device data, runs unaudited.)"""

    def __init__(self) -> None:
        self.graphs, self.audit = 0, None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs += 1

        def run(*args):
            with self.audit:
                return gm(*args)

        return run

    def run(self, runner: ModelRunner, audit: PassAudit, rows: list, logits: str) -> torch.Tensor:
        """`runner.forward`'s compiled branch for these rows (an expert-parallel rank's: its graphs
        and, audited too, the eager all-to-all between them); the logits' hand-off to the host
        (outside the graphs: a copy a `meta` tensor cannot make) answered with zeros."""
        self.audit = audit
        step = runner.compiled
        for r in rows:
            runner.prepare(r.seq_id, r.start, r.tokens)
        starts, q_lens, tq = [r.start for r in rows], [len(r.tokens) for r in rows], max(len(r.tokens) for r in rows)
        if not step.accepts(len(rows), tq):
            raise DryRunError(f"{audit.name}: the compiled step does not take {len(rows)} rows of {tq}")
        ids = torch.tensor([r.tokens + [0] * (tq - len(r.tokens)) for r in rows], device=runner.device)  # [B, Tq]
        tables = runner.block_tables([r.seq_id for r in rows], -(-(max(starts) + tq) // runner.block_size))
        try:
            if isinstance(step, CompiledShardStep):
                moe = step._moe
                with mock.patch.object(step, "_moe", lambda *a: self._audited(moe, *a)):
                    on = lambda v: torch.tensor(v, device=runner.device)  # noqa: E731
                    h = step.hidden_states(ids, tables, on(starts), on(q_lens), logits == "last", q_lens)
                out = runner.model.lm_logits(h)  # [B, T', V]
            else:
                out = step(ids, tables, starts, q_lens)  # [B, Tq, V]
        except (RuntimeError, NotImplementedError) as e:
            if "meta tensor" not in str(e):  # only a read of data outside a graph (meta has none) is a sync
                raise
            raise DryRunError(f"{audit.name}: host sync in the compiled step ({e}); "
                              f"graph breaks: {dict(counters['graph_break'])}") from e
        audit.handoffs += 1
        return torch.zeros(out.shape[0], out.shape[-1]) if logits == "last" else torch.zeros(out.shape)

    def _audited(self, fn, *args):
        with self.audit:
            return fn(*args)


# ---- the run ------------------------------------------------------------------------------------
@dataclass
class DryRun:
    """What the dry run found: memory per GPU (bytes), host syncs per pass, loaded bytes."""

    model: str
    gpus: int
    batch: int
    context: int
    weights: int = 0
    kv_cache: int = 0
    loaded: int = 0
    workspace: dict[str, int] = field(default_factory=dict)
    syncs: dict[str, int] = field(default_factory=dict)
    graphs: int = 0  # compiled: dynamo graphs of the decode and verify passes
    predicted_gib: dict[str, float] = field(default_factory=dict)

    def memory_gib(self) -> dict[str, float]:
        return {"weights": self.weights / 2**30, "kv": self.kv_cache / 2**30,
                "workspace": max(self.workspace.values(), default=0) / 2**30}

    def agreement(self) -> dict[str, float]:
        """Dry run over scale model, for weights, the KV cache and both together."""
        ours, theirs = self.memory_gib(), self.predicted_gib
        out = {k: ours[k] / theirs[k] for k in ("weights", "kv")}
        out["total"] = (ours["weights"] + ours["kv"]) / (theirs["weights"] + theirs["kv"])
        return out


@contextlib.contextmanager
def fake_group(world_size: int):
    """torch's `fake` process group of `world_size` ranks (this one rank 0): collectives move nothing."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shape_of(name: str) -> dict:
    path = SHAPES / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"no model shape {name!r}: one of {sorted(p.stem for p in SHAPES.glob('*.json'))}")
    return json.loads(path.read_text())


def dry_run(name: str, gpus: int = 8, batch: int = 64, context: int = 2048, prompt: int = 64,
            draft: int = 3, compiled: bool = False, layers: int | None = None) -> DryRun:
    """Load rank 0 of `gpus` for the model `name` (bench/shapes/), with a KV cache for `batch`
    sequences of `context` tokens; prefill `batch` prompts of `prompt` tokens, decode one step and
    verify `draft` drafted tokens a row. Raises DryRunError on a defect.

    compiled: decode and verify run compiled as the engine runs them: on one GPU every expert
    local (LocalDispatch) in CompiledStep's graph; on a rank of several, CompiledShardStep's graphs
    between its eager all-to-alls (audited as well). Graphs are traced by dynamo and run by
    `AuditedGraphs` (inductor cannot target `meta`); a graph break or a host sync fails the run.
    Prefill stays eager.
    layers: keep only the first `layers` decoder layers (full width; every layer runs the same code)."""
    hf = shape_of(name)
    if layers is not None:
        hf = {**hf, "num_hidden_layers": layers}
    cfg = ModelConfig.from_hf(hf, source=name)
    placement = contiguous_placement(cfg.num_experts, gpus)
    result = DryRun(name, gpus, batch, context)
    lay = Layout(gpus=gpus, batch=batch, context=context)
    result.predicted_gib = step(Shape.from_hf(hf, name), HARDWARE["h200"], lay)["memory_gib"]
    grouped = sys.modules[LocalExperts.__module__]
    with fake_group(gpus), mock.patch.object(grouped, "grouped_mm_supported", experts_grouped_on_gpu):
        model = load_rank(hf, placement.rank_experts[0])
        result.loaded = model.loaded_bytes
        dispatch = AllToAllDispatch(placement, 0, padded=True)
        model.set_dispatch(dispatch)
        result.weights = sum(p.numel() * p.element_size() for p in model.parameters())
        runner = ModelRunner(model, batch, context, prefix_caching=False)
        result.kv_cache = runner.cache.nbytes
        _check_dtypes(model, runner)
        ids = [f"s{i}" for i in range(batch)]
        for sid in ids:
            runner.add(sid)
        sampler, params = Sampler(), [SamplingParams(temperature=0.0)] * batch
        passes = [("prefill", [Row(s, [1] * prompt, 0) for s in ids], "last", False),
                  ("decode", [Row(s, [1], prompt) for s in ids], "last", True),
                  ("verify", [Row(s, [1] * (draft + 1), prompt + 1) for s in ids], "all", True)]
        graphs = AuditedGraphs()
        for pass_name, rows, logits, strict in passes:
            tokens = max(len(r.tokens) for r in rows) * len(rows)
            dispatch.max_tokens = tokens  # as the step driver sets it: the most any rank routes
            fixed = None if strict else FixedRouting(placement, 0)
            audit = PassAudit(pass_name, strict, handoff(cfg.vocab_size, fixed))
            if compiled and pass_name != "prefill":
                out = graphs.run(runner, audit, rows, logits)
            else:
                with audit:
                    out = runner.forward(rows, logits=logits)
            if compiled and pass_name == "prefill":
                torch._dynamo.reset()
                counters["graph_break"].clear()  # this run's graphs only
                if gpus == 1:
                    model.set_dispatch(LocalDispatch())
                    runner.compiled = CompiledStep(model, runner.cache, backend=graphs)
                else:
                    runner.compiled = CompiledShardStep(model, runner.cache, backend=graphs)
            if audit.handoffs != 1 or out.dtype != torch.float32 or out.device.type != "cpu":
                raise DryRunError(f"{pass_name}: logits must reach the sampler once, fp32 on the host; "
                                  f"got {audit.handoffs} hand-offs of {out.dtype} on {out.device}")
            sampler.sample(out, params)
            result.workspace[pass_name], result.syncs[pass_name] = audit.peak, len(audit.syncs)
        if compiled:
            breaks = dict(counters["graph_break"])
            if breaks or runner.compiled.num_calls != 2 or not graphs.graphs:
                raise DryRunError(f"compiled decode/verify: {runner.compiled.num_calls} calls, {graphs.graphs} "
                                  f"graphs, graph breaks {breaks}")
            result.graphs = graphs.graphs
    return result


def _check_dtypes(model: torch.nn.Module, runner: ModelRunner) -> None:
    """Weights and the KV cache in bf16 on the configured device (the rotary frequencies aside:
    positions times frequencies are computed in fp32 and cast)."""
    for name, t in [*model.named_parameters(), *model.named_buffers(), *(("kv", t) for t in runner.cache.kv)]:
        if t.device.type != "meta":
            raise DryRunError(f"{name} is on {t.device}, not the configured device")
        if t.dtype != DTYPE and not name.endswith("inv_freq"):
            raise DryRunError(f"{name} is {t.dtype}, not {DTYPE}")


def report(r: DryRun) -> str:
    mem, agree = r.memory_gib(), r.agreement()
    lines = [f"{r.model}: rank 0 of {r.gpus}, {r.batch} sequences x {r.context} tokens, bf16 on meta: passed",
             f"  loaded {r.loaded / 2**30:.2f} GiB of the checkpoint (this rank's experts)",
             f"  memory per GPU: weights {mem['weights']:.2f} GiB, KV cache {mem['kv']:.2f} GiB, "
             f"workspace {mem['workspace']:.2f} GiB (" + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in r.workspace.items())
             + ")",
             f"  scale model: weights {r.predicted_gib['weights']:.2f} GiB, KV {r.predicted_gib['kv']:.2f} GiB; "
             "dry run / scale model: " + ", ".join(f"{k} {v:.3f}" for k, v in agree.items()),
             "  host syncs besides the logits' hand-off: " + ", ".join(f"{k} {v}" for k, v in r.syncs.items())
             + " (prefill: the exact all-to-all's reads, answered by the fixed routing)"]
    if r.graphs:
        lines.append(f"  decode and verify compiled: {r.graphs} graphs, no graph break")
    return "\n".join(lines)
