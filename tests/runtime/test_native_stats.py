"""The one-pass C statistics (picklehooks._native, csrc/stats.c) against float64 PyTorch.

The ground truth is plain float64 PyTorch arithmetic on the same values
(:func:`reference`), and :func:`picklehooks._stats.tensor_stats` for the
NaN/Inf semantics; nothing is compared with numbers the kernel produced.

With the Python twin (``PICKLEHOOKS_NATIVE=0``: tests/test_native_twin.py runs
this file so too) there is no pass to check: :func:`picklehooks._native.stats`
is ``None`` for every tensor (``test_with_the_twin_every_tensor_is_left_to_pytorch``),
and logs reduce with PyTorch (tests/capture/test_stats_faithful.py holds that path to plain PyTorch).
"""

from __future__ import annotations

import ast
import math
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picklehooks import _native
from picklehooks._stats import STAT_NAMES, tensor_stats

needs_native = pytest.mark.skipif(
    not _native.AVAILABLE,
    reason="picklehooks._speedups is not built here (no C compiler at install time) or PICKLEHOOKS_NATIVE=0: "
           "the Python twin reads no tensor",
)
# This run was asked for the twin (the extension may be built): what doesn't depend on the switch ran in the other.
SWITCHED_OFF = os.environ.get("PICKLEHOOKS_NATIVE", "1").strip() == "0"
same_either_way = pytest.mark.skipif(SWITCHED_OFF, reason="the same with either implementation: ran in the other run")

ROOT = Path(__file__).resolve().parents[2]
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
F32_MIN, F32_MAX = torch.finfo(torch.float32).min, torch.finfo(torch.float32).max


def reference(x: torch.Tensor) -> list[float]:
    """The statistics by float64 PyTorch arithmetic on the same values (NaN/Inf propagate as torch does)."""
    d = x.detach().double().reshape(-1)
    return [
        d.mean().item(),
        d.std(unbiased=False).item(),
        d.min().item(),
        d.max().item(),
        d.abs().max().item(),
        torch.linalg.vector_norm(d).item(),
        float(d.isnan().sum()),
        float(d.isinf().sum()),
        (d == 0).double().mean().item(),
    ]


def assert_matches(got, want, *, rel=1e-9, x=None):
    """Counts, min, max, absmax and zero_frac exactly; mean, std and norm within ``rel``.

    The mean and std of data centred near 0 are compared with an absolute
    slack of 1e-12 * absmax too: both sides round each element's sum at the
    scale of the largest values, not of the mean.
    """
    assert got is not None, f"native stats refused {x!r:.200}"
    assert len(got) == len(STAT_NAMES)
    got = [float(v) for v in got]
    scale = want[4] if math.isfinite(want[4]) else 0.0
    for name, g, w in zip(STAT_NAMES, got, want):
        if math.isnan(w) or math.isnan(g):
            assert math.isnan(w) and math.isnan(g), (name, g, w)
        elif name in ("mean", "std", "norm"):
            assert g == w or abs(g - w) <= rel * max(abs(g), abs(w)) + (1e-12 * scale if name != "norm" else 0), (name, g, w)
        else:
            assert g == w, (name, g, w)


# --- values and layouts ---------------------------------------------------------

SPECIALS = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "zero": 0.0,
    "-zero": -0.0,
    "f32min": F32_MIN,
    "f32max": F32_MAX,
}


@st.composite
def strided_views(draw):
    """A view of any strides (0, overlapping, unsorted, offset) on a random base of any float dtype."""
    dtype = draw(st.sampled_from(FLOATS))
    ndim = draw(st.integers(0, 4))
    sizes = draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim))
    strides = draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim))
    offset = draw(st.integers(0, 3))
    length = offset + 1 + sum((n - 1) * s for n, s in zip(sizes, strides))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = 10.0 ** draw(st.integers(-30, 30))
    shift = draw(st.sampled_from([0.0, 1.0, -3.0, 1e4]))
    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(length, generator=gen, dtype=torch.float64) * scale + shift * scale).to(dtype)
    for kind in draw(st.lists(st.sampled_from(sorted(SPECIALS)), max_size=3)):
        base[draw(st.integers(0, length - 1))] = SPECIALS[kind]
    return base.as_strided(sizes, strides, offset)


@needs_native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strided_views())
def test_any_layout_and_dtype_matches_float64_torch(x):
    assert_matches(_native.stats(x), reference(x), x=x)


@needs_native
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "make",
    [
        lambda t: t,
        lambda t: t.t(),
        lambda t: t[::3, 1::2],
        lambda t: t[:, 5],
        lambda t: t[2:90, 3:40],
        lambda t: t.unsqueeze(1).expand(-1, 4, -1),
        lambda t: t.permute(1, 0)[::2],
        lambda t: t.reshape(4, 25, 40).transpose(0, 2)[:, 1:, ::3],
        lambda t: t.reshape(-1)[7:],
    ],
    ids=["contiguous", "t", "step-slices", "column", "block", "expand", "t-step", "3d-permuted", "offset"],
)
def test_torch_views(make, dtype):
    x = make(torch.randn(100, 40, dtype=torch.float64).to(dtype))
    assert_matches(_native.stats(x), reference(x), x=x)


@needs_native
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 511, 512, 513, 4095, 4096, 4097, 2 * 4096 + 15, 70_000, 1 << 20])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "stride2"])
def test_lengths_around_lanes_chunks_and_the_gil_threshold(n, strided):
    """Tails of the 16-lane loop, the 4096-element chunks, in-place runs (>= 512), and >= 65536 (no GIL)."""
    base = torch.randn(2 * n if strided else n) * 3 + 0.5
    x = base[::2] if strided else base
    assert_matches(_native.stats(x), reference(x), x=x)


@needs_native
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_negative_strides_through_the_raw_kernel(dtype):
    """torch has no negative-stride views, but the kernel takes them: address the flipped element 0."""
    speedups = _native._speedups
    code = speedups.DTYPE_CODES[str(dtype).removeprefix("torch.")]
    base = torch.randn(6, 700, dtype=torch.float64).to(dtype)
    base[2, 3], base[4, 0] = 0.0, math.inf
    for sizes, strides, first, view in (
        ((6, 700), (-700, 1), base[5, 0], base.flip(0)),
        ((6, 700), (-700, -1), base[5, 699], base.flip(0, 1)),
        ((700, 6), (-1, 700), base[0, 699], base.flip(1).t()),
        ((3, 350), (-1400, -2), base[4, 698], base.flip(0, 1)[1::2, 1::2]),
    ):
        got = speedups.stats(first.data_ptr(), code, sizes, strides)
        assert_matches(got, reference(view), x=(sizes, strides))


@needs_native
def test_long_rows_and_many_short_rows():
    for x in (torch.randn(3, 9000), torch.randn(9000, 3), torch.randn(300, 700)[:, :300], torch.randn(5, 5000)[:, ::7]):
        assert_matches(_native.stats(x), reference(x), x=x)


# --- semantics: NaN, Inf, zeros, special values ---------------------------------------


@needs_native
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "specials",
    [["nan"], ["inf"], ["-inf"], ["inf", "-inf"], ["nan", "inf"], ["nan", "nan", "-inf"]],
    ids=lambda s: "+".join(s),
)
def test_nan_and_inf_as_tensor_stats(specials, dtype):
    """Any NaN: mean/std/min/max/absmax/norm NaN; Inf: std NaN, norm Inf, mean +-Inf (NaN with both signs)."""
    x = torch.randn(50, 30, dtype=torch.float64).to(dtype)
    for i, kind in enumerate(specials):
        x.view(-1)[37 * i + 5] = SPECIALS[kind]
    got, want = _native.stats(x), tensor_stats(x)
    assert got is not None
    assert torch.equal(torch.tensor(got).isnan(), torch.tensor(want).isnan())
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), equal_nan=True, rtol=1e-9, atol=0)
    assert_matches(got, reference(x), x=x)


@needs_native
def test_nan_and_inf_counts_in_an_expanded_view():
    x = torch.tensor([1.0, math.nan, math.inf, 0.0]).expand(3, 4)
    got = _native.stats(x)
    assert (got[6], got[7], got[8]) == (3.0, 3.0, 0.25)
    assert_matches(got, reference(x), x=x)


@needs_native
@pytest.mark.parametrize(
    "fill",
    [
        lambda m: m[:, 128:].fill_(F32_MIN),
        lambda m: m.fill_(F32_MIN),
        lambda m: (m.view(-1)[::2].fill_(F32_MIN), m.view(-1)[1::2].fill_(F32_MAX)),
        lambda m: m.add_(torch.randn(m.shape)).view(-1)[::3].fill_(F32_MIN),
        lambda m: m.fill_(F32_MIN).triu_(1),
    ],
    ids=["half-masked", "all-min", "min-max-alternating", "noise-and-min", "causal"],
)
def test_attention_masks_are_finite_and_exact(fill):
    """finfo(float32).min-filled masks: a float32 sum would overflow; float64 sums keep every statistic finite."""
    m = torch.zeros(32, 256)
    fill(m)
    got, want = _native.stats(m), reference(m)
    assert got is not None and all(math.isfinite(v) for v in got), got
    assert_matches(got, want, rel=1e-6, x=m)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mean,std", [(1e4, 1e-3), (-1e4, 1e-3), (1e6, 1.0), (3.0, 1e-7)])
def test_ill_conditioned_std(dtype, mean, std):
    """|mean| >> std: std (and mean) within 1e-6 of float64 on the same values (naive sum of squares: ~1e-2 off)."""
    x = (mean + std * torch.randn(100_000, dtype=torch.float64)).to(dtype)
    got, want = _native.stats(x), reference(x)
    assert want[1] > 0
    assert abs(got[1] - want[1]) <= 1e-6 * want[1], (got[1], want[1])
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0])
    assert_matches(got, want, x=x)


@needs_native
def test_an_outlier_first_then_constant_data():
    """The first element (the shift of the first chunk) far from the rest still gives a precise std."""
    x = torch.full((100_000,), 2.5)
    x[0] = 1e6
    x[1:] += torch.randn(99_999) * 1e-3
    assert_matches(_native.stats(x), reference(x), x=x)


@needs_native
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_zeros_single_elements_and_scalars(dtype):
    for x in (
        torch.zeros(1000, dtype=dtype),
        torch.tensor([0.0, -0.0, 0.0, -0.0], dtype=dtype),
        torch.tensor([0.0, 1.0, 0.0, -2.0], dtype=dtype),
        torch.tensor([-3.5], dtype=dtype),
        torch.tensor(7.25, dtype=dtype),
        torch.tensor(0.0, dtype=dtype),
        torch.zeros(3, 1, 4, dtype=dtype).expand(3, 5, 4),
    ):
        assert_matches(_native.stats(x), reference(x), x=x)
    z = _native.stats(torch.zeros(10, dtype=dtype))
    assert z[:6] == (0.0,) * 6 and z[8] == 1.0


@needs_native
def test_every_float16_and_bfloat16_value_converts_exactly():
    """All 65536 bit patterns, one element at a time (min == the value) and all together."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        values = bits.view(dtype)
        exact = values.double().tolist()
        for i, want in enumerate(exact):
            got = _native.stats(values[i])[2]
            assert got == want or (math.isnan(got) and math.isnan(want)), (dtype, i, got, want)
        finite = values[torch.isfinite(values)]
        assert_matches(_native.stats(finite), reference(finite), x=dtype)
        assert_matches(_native.stats(values), reference(values), x=dtype)


@needs_native
def test_float64_in_range_extremes_are_exact():
    for x in (
        torch.tensor([2.0**440, -(2.0**439), 3.0 * 2.0**438], dtype=torch.float64),
        torch.tensor([2.0**-390, 3 * 2.0**-390, 0.0], dtype=torch.float64),
    ):
        got = _native.stats(x)
        assert_matches(got, reference(x), x=x)
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(tensor_stats(x), dtype=torch.float64), rtol=1e-9, atol=0)


@needs_native
def test_parameters_and_tensors_that_require_grad():
    p = torch.nn.Parameter(torch.randn(20, 30))
    y = p * 2
    assert y.requires_grad
    for x in (p, y, y.t()):
        assert_matches(_native.stats(x), reference(x), x=x)


@needs_native
def test_threads_get_their_own_results():
    """Large tensors are reduced without the GIL; concurrent calls must not mix their state."""
    xs = [torch.randn(300_000) * (i + 1) + i for i in range(4)]
    want = [reference(x) for x in xs]
    results: dict = {}

    def work(i):
        results[i] = [_native.stats(xs[i]) for _ in range(5)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        for got in results[i]:
            assert_matches(got, want[i], x=i)


# --- None: what the kernel doesn't handle -------------------------------------------


class _Sub(torch.Tensor):
    pass


def _unsupported():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(3)
    z = torch.randn(4, dtype=torch.complex64)
    neg = z.conj().imag
    assert neg.is_neg()
    freed = torch.randn(10)
    freed.untyped_storage().resize_(0)
    with warnings.catch_warnings():  # torch's beta/deprecation notes about these layouts
        warnings.simplefilter("ignore")
        odd = {
            "sparse": torch.eye(3).to_sparse(),
            "sparse-csr": torch.eye(3).to_sparse_csr(),
            "mkldnn": torch.ones(3, 4).to_mkldnn(),
            "quantized": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
        }
    return odd | {
        "empty": torch.empty(0),
        "empty-2d": torch.empty(3, 0),
        "int32": torch.ones(3, dtype=torch.int32),
        "int64": torch.ones(3, dtype=torch.int64),
        "uint8": torch.ones(3, dtype=torch.uint8),
        "bool": torch.ones(3, dtype=torch.bool),
        "complex": z,
        "conj": z.conj(),
        "neg-bit": neg,
        "meta": torch.ones(3, device="meta"),
        "fake": fake,
        "subclass": torch.ones(3).as_subclass(_Sub),
        "efficient-zero": torch._efficientzerotensor(3),
        "freed-storage": freed,
        "float64-huge": torch.tensor([1e300, 1.0], dtype=torch.float64),
        "float64-tiny": torch.tensor([1e-300, 0.0], dtype=torch.float64),
        "float64-inf-and-huge": torch.tensor([math.inf, -1e200, -1e200], dtype=torch.float64),
    }


UNSUPPORTED = (
    "bool", "complex", "conj", "efficient-zero", "empty", "empty-2d", "fake", "float64-huge", "float64-inf-and-huge",
    "float64-tiny", "freed-storage", "int32", "int64", "meta", "mkldnn", "neg-bit", "quantized", "sparse",
    "sparse-csr", "subclass", "uint8",
)


def test_the_unsupported_list_is_complete():
    assert sorted(UNSUPPORTED) == sorted(_unsupported())


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_none_for_what_it_does_not_handle(name):
    assert _native.stats(_unsupported()[name]) is None


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_none_for_nested_and_vmapped_tensors():
    for layout in (torch.strided, torch.jagged):
        nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=layout)
        assert _native.stats(nested) is None
    seen = []
    torch.func.vmap(lambda t: seen.append(_native.stats(t)) or t)(torch.randn(3, 4))
    assert seen == [None]


@needs_native
def test_the_kernel_refuses_bad_arguments():
    kernel = _native._speedups.stats
    x = torch.ones(3)
    assert kernel(0, 0, (3,), (1,)) is None  # null pointer
    assert kernel(x.data_ptr() + 1, 0, (3,), (1,)) is None  # misaligned
    assert kernel(x.data_ptr(), 0, (1,) * 65, (1,) * 65) is None  # too many dims
    with pytest.raises(ValueError):
        kernel(x.data_ptr(), 9, (3,), (1,))
    with pytest.raises(ValueError):
        kernel(x.data_ptr(), 0, (3,), (1, 1))
    with pytest.raises(TypeError):
        kernel(x.data_ptr(), 0, (3,))


@pytest.mark.skipif(_native.AVAILABLE, reason="the C pass is on here: the tests above hold it to float64 PyTorch")
@pytest.mark.parametrize("make", [
    lambda: torch.randn(100, 40),
    lambda: torch.randn(100, 40, dtype=torch.float64).t(),
    lambda: torch.randn(5000).half()[::3],
    lambda: torch.nn.Parameter(torch.randn(3, 4).bfloat16()),
    lambda: torch.tensor([1.0, float("nan"), float("inf")]),
], ids=["float32", "float64-t", "float16-strided", "bfloat16-parameter", "nan-inf"])
def test_with_the_twin_every_tensor_is_left_to_pytorch(make):
    """The twin: the tensors the C pass reads are ``None`` too (the log reduces them with PyTorch)."""
    assert _native._impl is _native._twin and not _native._CODES
    x = make()
    assert _native.stats(x) is None
    assert _native._twin.stats(x.data_ptr(), 0, x.shape, x.stride()) is None


# --- switches, packaging, installation ------------------------------------------------


def _python(code: str, env_extra: dict | None = None, **kwargs) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PICKLEHOOKS_NATIVE")}
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300, **kwargs)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_environment_switch_turns_it_off_in_a_fresh_process():
    code = """
        import torch
        from picklehooks import _native
        print(_native.AVAILABLE, _native._impl is _native._twin, _native.stats(torch.ones(3)) is None)
    """
    assert _python(code, {"PICKLEHOOKS_NATIVE": "0"}).split() == ["False", "True", "True"]
    built = _native._speedups is not None
    assert _python(code, {"PICKLEHOOKS_NATIVE": "1"}).split() == [str(built), str(not built), str(not built)]


@needs_native
def test_float32_lane_loop_and_its_avx512_spelling_give_the_same_bits():
    """Where float32 runs the AVX-512 loop, the portable lane loop (PICKLEHOOKS_F32_LOOP=lanes) gives
    the same bits on the same data: so the float64-reference tests above, run with the default,
    cover both. Lengths around the 16 lanes and the 4096-element chunk; zeros, -0.0, NaN, Inf,
    a large mean, strided views."""
    if _native._speedups.F32_LOOP != "avx512":
        pytest.skip(f"float32 runs the {_native._speedups.F32_LOOP!r} loop here (no AVX-512F, or built without it)")
    code = """
        import torch
        from picklehooks import _native
        print(_native._speedups.F32_LOOP)
        g = torch.Generator().manual_seed(0)
        for n in (1, 2, 15, 16, 17, 31, 33, 100, 4095, 4096, 4097, 8192, 10001, 70000):
            for kind in ("randn", "zeros", "offset", "nan", "inf", "huge", "strided"):
                x = torch.randn(n, generator=g) * 3 + 1
                if kind == "zeros":
                    x[::3], x[1::7] = 0.0, -0.0
                elif kind == "offset":
                    x = torch.randn(n, generator=g) * 1e-3 + 1e4
                elif kind == "nan":
                    x[n // 2] = float("nan")
                elif kind == "inf":
                    x[n // 3] = float("inf")
                elif kind == "huge":
                    x = torch.randn(n, generator=g) * 1e30
                elif kind == "strided":
                    x = torch.randn(n, 3, generator=g)[:, 1]
                s = _native.stats(x)
                print(n, kind, None if s is None else [float(v).hex() for v in s])
    """
    avx = _python(code).splitlines()
    lanes = _python(code, {"PICKLEHOOKS_F32_LOOP": "lanes"}).splitlines()
    assert (avx[0], lanes[0]) == ("avx512", "lanes")
    assert len(avx) == 1 + 14 * 7
    assert avx[1:] == lanes[1:]


def test_a_copy_in_a_torch_package_archive_imports_and_is_off(tmp_path):
    """Interning _native must not drag the extension into the archive; the archive's copy is off."""
    from torch.package import PackageExporter, PackageImporter

    from picklehooks import _shim

    for how in ("intern", "runtime-copy"):
        path = tmp_path / f"{how}.pt"
        with PackageExporter(path) as pe:
            if how == "intern":
                pe.extern(["torch", "torch.**"])
                pe.intern(["picklehooks", "picklehooks._native"])
            else:  # how picklehooks copies its runtime modules into archives
                _shim.prepare_exporter(pe)
                _shim._package_own_module(pe, "picklehooks._native")
            pe.save_source_string("user", "from picklehooks import _native\n")
        copy = PackageImporter(path).import_module("user")._native
        assert copy.__name__ != _native.__name__
        assert copy.AVAILABLE is False and copy.stats(torch.ones(3)) is None
        assert copy._speedups is None and copy._impl is copy._twin  # its own twin, not the host's extension


def _source_copy(dest: Path) -> Path:
    """The files an install needs, without anything built here (.so, build/, egg-info)."""
    src = dest / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    for folder in ("picklehooks", "csrc"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return src


def _pip_install_target(tmp_path: Path, env_extra: dict) -> Path:
    src, target = _source_copy(tmp_path), tmp_path / "site"
    env = dict(os.environ, **env_extra)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def _import_from(target: Path) -> list[str]:
    code = """
        # Only the copy in the target: not this checkout's editable install (a meta path finder).
        sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
        import torch, picklehooks, picklehooks._native as n
        assert picklehooks.__file__.startswith(sys.argv[1]), picklehooks.__file__
        s = n.stats(torch.tensor([1.0, 3.0]))
        dump = torch._C._dispatch_dump("picklehooks::active")
        print("C" if "csrc/kernels.c" in dump else "Python", end=" ")  # the active op's kernel
        print(n.AVAILABLE, s if s is None else tuple(s))
    """
    env = {k: v for k, v in os.environ.items() if k != "PICKLEHOOKS_NATIVE"}
    env["PYTHONPATH"] = str(target)
    # cwd: not the checkout, which python -c would put first on sys.path
    proc = subprocess.run([sys.executable, "-c", "import sys\n" + textwrap.dedent(code), str(target)], capture_output=True, text=True, env=env, timeout=300, cwd=target)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split(maxsplit=2)


@same_either_way
def test_installs_and_imports_without_a_c_compiler(tmp_path):
    """CC=/bin/false: the optional extension is skipped, the install succeeds, the fallback is on.

    Slow-ish (a pip install into a temporary directory, ~5 s here).
    """
    target = _pip_install_target(tmp_path, {"CC": "/bin/false", "LDSHARED": "/bin/false"})
    assert not list(target.rglob("*.so")) and not list(target.rglob("*.pyd"))
    assert (target / "picklehooks" / "_native.py").exists()
    assert _import_from(target) == ["Python", "False", "None\n"]


@same_either_way
@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")
def test_installs_with_the_extension_where_there_is_a_compiler(tmp_path):
    """The same install with the compiler builds and loads the extension (slow-ish: it compiles, ~8 s here)."""
    target = _pip_install_target(tmp_path, {})
    assert [p.name.split(".")[0] for p in target.rglob("*.so")] == ["_speedups"]  # the one extension
    kernel, available, result = _import_from(target)
    assert kernel == "C"  # built as plain C, registered through libtorch's C shim: no torch headers
    # [1, 3]: mean 2, std 1, min 1, max 3, absmax 3, norm sqrt(10), no NaN/Inf/zeros
    assert available == "True"
    assert_matches(ast.literal_eval(result), [2.0, 1.0, 1.0, 3.0, 3.0, math.sqrt(10), 0.0, 0.0, 0.0])


# -- Stats: the one object the kernel returns ------------------------------------------------------

@needs_native
def test_stats_object_behaves_as_the_tuple_of_its_floats():
    import copy
    import pickle
    import pickletools

    x = torch.tensor([1.0, 3.0, 0.0, -2.0])
    s = _native.stats(x)
    want = tuple(tensor_stats(x))
    assert len(s) == 9 and tuple(s) == pytest.approx(want, rel=1e-12)
    assert s == tuple(s) and tuple(s) == s and s == s and not (s != tuple(s))
    assert s[0] == s[-9] and s[8] == s[-1] and s[2:4] == tuple(s)[2:4] and list(s) == list(tuple(s))
    assert all(type(v) is float for v in s)
    with pytest.raises(IndexError):
        s[9]
    with pytest.raises(IndexError):
        s[-10]
    with pytest.raises(TypeError):
        hash(s)
    with pytest.raises(TypeError):
        s[0] = 1.0
    assert repr(s) == f"Stats{tuple(s)!r}"
    assert dict(zip(STAT_NAMES, s)) == dict(zip(STAT_NAMES, tuple(s)))
    # Saved and copied as a plain tuple: nothing saved refers to the extension.
    blob = pickle.dumps(s)
    assert b"_speedups" not in blob and "Stats" not in str(list(pickletools.genops(blob)))
    for copied in (pickle.loads(blob), copy.copy(s), copy.deepcopy(s)):
        assert type(copied) is tuple and copied == tuple(s)
    nan = _native.stats(torch.tensor([1.0, float("nan")]))
    assert nan == nan and nan != _native.stats(torch.tensor([1.0, float("nan")]))  # as tuples of floats compare


@needs_native
def test_records_holding_unread_stats_pickle_without_the_extension():
    """A Record keeps its Stats until read; pickled before that, the file names no extension type."""
    import pickle

    import picklehooks

    model = torch.nn.Linear(3, 2)
    picklehooks.instrument(model, modules=[""])
    with picklehooks.record() as log:
        model(torch.randn(4, 3))
    record = log.records[0]
    assert type(record._src).__name__ == "Stats"  # not read yet
    blob = pickle.dumps(record)
    assert b"_speedups" not in blob
    assert pickle.loads(blob).stats == record.stats
