"""The bucket as the unit of compression (issue 47): every built-in compressor gives on a
bucket the bits it gave tensor by tensor (recorded in tests/fixtures/compressor_reference.json
by tests/make_compressor_reference.py), a compressor written per tensor works unchanged, error
feedback keeps one flat residual per bucket, and no compressor synchronises with the host in
its step on a GPU (counted under numba's CUDA simulator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import make_compressor_reference as reference
import numba_kernels as nk
from dsgd_cli.api import Compressor, ErrorFeedback, Payload, compressed_average
from dsgd_cli.comm.compressed import bucket_layout, flat_bucket

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def recorded():
    return json.loads(reference.FIXTURE.read_text())


@pytest.fixture(scope="module")
def computed():
    return reference.compute()


@pytest.mark.parametrize("config", sorted(reference.CONFIGS))
def test_every_built_in_compressor_gives_the_recorded_bits(config, recorded, computed):
    """Averages, residuals, each worker's payload and its decompression, and the combination
    of two workers' payloads: the same bits as the per-tensor code (PowerSGD: the same
    numbers within float tolerance, as its products depend on the BLAS)."""
    expected, got = recorded[config], computed[config]
    assert sorted(got) == sorted(expected)
    for label, value in expected.items():
        if isinstance(value, str):
            assert got[label] == value, f"{config}: {label} differs from the recorded bits"
        else:
            torch.testing.assert_close(torch.tensor(got[label]), torch.tensor(value),
                                       rtol=1e-5, atol=1e-5, msg=f"{config}: {label}")


NON_SUMMABLE = ["qsgd", "qsgd-b100-l4", "dqsgd", "terngrad", "sign", "ef_sign", "onebit", "topk"]


@pytest.mark.parametrize("config", NON_SUMMABLE)
def test_a_bucket_of_two_workers_combines_as_its_tensors_do(config):
    """Workers with their own data: the bucket's combination, decompressions and payload
    sizes are those of its tensors one by one."""
    options = reference.CONFIGS[config]
    shapes = [(13, 5), (1,), (0,), (700,), (9, 1)]
    keys = [f"w{i}" for i in range(len(shapes))]
    workers = [reference.make(options, rank) for rank in (0, 1)]
    data = [reference.inputs(rank, 3, shapes) for rank in (0, 1)]
    layout = bucket_layout(keys, data[0])
    flats = [flat_bucket(layout, tensors).clone() for tensors in data]
    payloads = [c.compress_bucket(flat, layout, 4) for c, flat in zip(workers, flats)]
    combined = workers[0].combine_bucket(payloads, layout)
    own = workers[1].decompress_bucket(payloads[1], layout)
    sent = 0
    for i, key in enumerate(keys):
        x0, x1 = data[0][i], data[1][i]
        if not x0.numel():
            continue
        p0, p1 = workers[0].compress(x0, key, 4), workers[1].compress(x1, key, 4)
        sent += p0.nbytes
        view = layout.views(combined)[i]
        assert torch.equal(view, workers[0].combine([p0, p1], x0)), key
        assert torch.equal(layout.views(own)[i], workers[1].decompress(p1, x1)), key
    # an empty tensor sent nothing; in a bucket some send its per-tensor number all the same
    extra = {"dqsgd": 1, "ef_sign": 4, "onebit": 8}.get(config, 0)
    assert payloads[0].nbytes == sent + extra


class PerTensor(Compressor):
    """Written against the per-tensor API only: keeps the 2 largest entries of each tensor."""

    summable = False

    def __init__(self):
        super().__init__()
        self.calls = []

    def compress(self, tensor, key, step):
        self.calls.append((key, tuple(tensor.shape)))
        flat = tensor.reshape(-1)
        indices = flat.abs().topk(min(2, flat.numel())).indices
        return Payload([indices, flat[indices]], context=tensor.numel())

    def decompress(self, payload, like):
        out = torch.zeros(payload.context)
        out[payload.tensors[0]] = payload.tensors[1]
        return out.view(like.shape)


class TwoAlike(reference.TwoAlike):
    pass


def test_a_compressor_written_per_tensor_works_unchanged_in_buckets():
    """The default bucket methods call `compress` once per tensor, with its key and shape, and
    `decompress` / `combine` on each tensor's part of the payload; error feedback keeps one
    flat residual for the bucket."""
    tensors = [torch.tensor([[3.0, -1.0], [0.5, 4.0]]), torch.tensor([0.0, -7.0, 2.0]),
               torch.zeros(0)]
    keys = ["a", "b", "c"]
    compressor, memory = PerTensor(), ErrorFeedback()
    averages = compressed_average(compressor, TwoAlike(), tensors, keys, 0, memory)
    assert compressor.calls == [("a", (2, 2)), ("b", (3,))]
    assert averages[0].tolist() == [[3.0, 0.0], [0.0, 4.0]]
    assert averages[1].tolist() == [0.0, -7.0, 2.0]
    assert averages[2].shape == (0,)
    [(key, residual)] = memory.residuals.items()
    assert key == "a..c"
    assert residual.tolist() == [0.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    # the next step adds the residual back, on the bucket
    compressed_average(compressor, TwoAlike(), [t * 0 for t in tensors], keys, 1, memory)
    assert memory.residuals["a..c"].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_residuals_kept_per_tensor_become_the_bucket_residual():
    """A checkpoint of an earlier dsgd keeps one residual per tensor: the first bucketed step
    adds them all back, laid end to end."""
    tensors = [torch.zeros(2, 2), torch.zeros(3)]
    memory = ErrorFeedback()
    memory.residuals = {"a": torch.full((2, 2), 8.0), "b": torch.tensor([0.0, 0.0, -9.0])}
    [first, second] = compressed_average(reference.make({"name": "topk", "ratio": 0.5}, 0),
                                         reference.OneWorker(), tensors, ["a", "b"], 0, memory)
    assert first.tolist() == [[8.0, 8.0], [0.0, 0.0]] and second.tolist() == [0.0, 0.0, -9.0]
    assert list(memory.residuals) == ["a..b"]
    assert memory.residuals["a..b"].tolist() == [0.0, 0.0, 8.0, 8.0, 0.0, 0.0, 0.0]


def test_a_bucket_layout_and_its_tables_are_made_once():
    tensors = [torch.zeros(3, 4), torch.zeros(5)]
    layout = bucket_layout(["x", "y"], tensors)
    assert bucket_layout(["x", "y"], [torch.ones(3, 4), torch.ones(5)]) is layout
    assert (layout.sizes, layout.offsets, layout.numel) == ([12, 5], [0, 12], 17)
    compressor = reference.make({"name": "qsgd", "bucket_size": 8}, 0)
    compressor.compress_bucket(torch.randn(17), layout, 0)
    table = layout.cached("segments", lambda: None)
    assert isinstance(table, nk.Segments)
    compressor.compress_bucket(torch.randn(17), layout, 1)
    assert layout.cached("segments", lambda: None) is table
    norm_starts, total = table.norm_starts(8)
    assert norm_starts.tolist() == [0, 2] and total == 3  # 12 = 8 + 4, then 5: never straddled


def test_the_device_selections_pick_the_cpu_kernels_indices(monkeypatch):
    """On a GPU, top-k and random-k select with torch ops on the device; here on the CPU the
    same code must pick what the CPU kernels pick (random-k exactly: its keys are distinct;
    top-k on entries without ties)."""
    sizes = [1, 9, 300, 70000, 5]
    x = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(2))
    table = nk.Segments(sizes)
    ks, seeds = [1, 2, 15, 700, 5], [5, 6, 7, 8, 9]
    cpu = [nk.topk_segments(x, table, ks), nk.randomk_segments(x, table, ks, seeds)]
    monkeypatch.setattr(nk._dispatch, "SIMULATE_CUDA", True)
    device = [nk.topk_segments(x, table, ks), nk.randomk_segments(x, table, ks, seeds)]
    for (i0, v0), (i1, v1) in zip(cpu, device):
        assert torch.equal(i0, i1) and torch.equal(v0, v1)


# -- no synchronisation with the host in a compressor's step ------------------------------------

SYNC_SCRIPT = textwrap.dedent(r'''
    import json, sys, warnings
    sys.setswitchinterval(5e-5)
    warnings.simplefilter("ignore")
    import torch
    from torch.overrides import TorchFunctionMode
    import numba_kernels as nk
    from numba_kernels import _cuda, _dispatch
    sys.path.insert(0, "tests")
    import make_compressor_reference as reference
    from dsgd_cli.comm.compressed import bucket_layout, flat_bucket

    assert _cuda.SIM, "not under the CUDA simulator"
    _dispatch.SIMULATE_CUDA = True  # CPU tensors stand in for CUDA ones, as on a GPU
    syncs = []

    # What would make the host wait for a GPU: reading a tensor's value into Python, or an
    # operation whose output size depends on the data.
    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
             "masked_select", "cpu", "unique"}

    class CountSyncs(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in READS:
                syncs.append(name)
            if name == "__getitem__" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                             for a in args[1:]):
                syncs.append("boolean index")
            return func(*args, **(kwargs or {}))

    real_to_host = _cuda._to_host

    def to_host(*args, **kwargs):
        syncs.append("numba copy to host")
        return real_to_host(*args, **kwargs)

    _cuda._to_host = to_host
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    launches = []
    real_call = FakeCUDAKernel.__call__

    def call(self, *args, **kwargs):
        if not self._device:  # a launch, not a device function called by a kernel
            launches.append(self.fn.__name__)
        return real_call(self, *args, **kwargs)

    FakeCUDAKernel.__call__ = call
    results = {}
    for config in sys.argv[1:]:
        found = {"syncs": [], "launches": []}
        for shapes in ([(5, 3), (1,), (20,)], [(5, 3), (1,), (20,), (2, 2), (7,), (3,), (9,)]):
            workers = [reference.make(reference.CONFIGS[config], rank) for rank in (0, 1)]
            data = [reference.inputs(rank, 0, shapes) for rank in (0, 1)]
            layout = bucket_layout([f"t{i}" for i in range(len(shapes))], data[0])
            flats = [flat_bucket(layout, tensors).clone() for tensors in data]
            for step in range(2):  # the second step finds everything made once already
                del syncs[:], launches[:]
                with CountSyncs():
                    payloads = [c.compress_bucket(f, layout, step) for c, f in zip(workers, flats)]
                    workers[0].decompress_bucket(payloads[0], layout)
                    if not workers[0].summable:
                        workers[0].combine_bucket(payloads, layout)
            found["syncs"] += syncs
            found["launches"].append(len(launches))
        results[config] = found
    print(json.dumps(results))
''')

# dqsgd chooses its levels on the host from the gradient (an exact variance per candidate)
# and decodes each worker's payload at that worker's widths: it waits by design.
NO_SYNC = ["none", "fp16", "bf16", "qsgd", "qsgd-b100-l4", "qsgd-rescale", "terngrad", "sign",
           "ef_sign", "onebit", "topk", "randomk", "randomk-biased"]


@pytest.mark.skipif(not __import__("importlib").util.find_spec("numba.cuda"),
                    reason="numba.cuda is not installed")
def test_no_compressor_step_waits_for_the_gpu():
    """Under numba's CUDA simulator, with CPU tensors standing in for CUDA ones: no
    compressor's step (two workers' compress_bucket, a decompress_bucket, combine_bucket)
    reads a value back to the host, and the numba kernels it launches are as many for a bucket
    of 7 tensors as for one of 3 (one or two launches per bucket, not per tensor)."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "NUMBA_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SYNC_SCRIPT, *NO_SYNC], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    waits = {config: found["syncs"] for config, found in results.items() if found["syncs"]}
    assert not waits, f"host synchronisations in a compressor's step: {waits}"
    per_tensor = {config: found["launches"] for config, found in results.items()
                  if found["launches"][0] != found["launches"][1]}
    assert not per_tensor, f"kernel launches (3 tensors, 7 tensors) that grow with the tensors: {per_tensor}"
