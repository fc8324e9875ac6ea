"""The fused sampling ops against the reference step, noise_schedule.p_step.

Specification: for every sampler, state dtype, memory layout (aligned or not) and step index,
``fused_step_`` writes exactly (bit for bit) the reference's x_prev into x and pred_xstart into
xstart, rounded to the state dtype; ``gather_timestep_`` fills t with timesteps[step]; bad
arguments raise RuntimeError naming the problem; ``torch.library.opcheck`` passes. CPU tests
always run; ``@pytest.mark.gpu`` tests run the same checks on the CUDA kernels when a GPU is
present (plus graph capture and large tensors).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from dataclasses import replace

import pytest
import torch

from ddpm.kernels import ops
from ddpm.kernels.build import BUILD_COMMAND, EXTENSION_NAME
from noise_schedule import NoiseSchedule, SamplingPlan, ScheduleConfig, guided_eps, p_step

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NUM_STEPS = 20
SCHEDULE = NoiseSchedule(ScheduleConfig(num_timesteps=200))
PLAN_CASES = {
    "ddpm": dict(sampler="ddpm"),
    "ddpm_fixed_large": dict(sampler="ddpm", variance_type="fixed_large"),
    "ddim_eta0": dict(sampler="ddim", eta=0.0),
    "ddim_eta1": dict(sampler="ddim", eta=1.0),
    "dpm_solver": dict(sampler="dpm_solver"),
    "dpm_solver_sde": dict(sampler="dpm_solver_sde"),  # noise and the previous x0 in one step
    "consistency": dict(sampler="consistency"),
    # Students predicting velocity or x_0: k_xt = 1 with v's (a, s), and k_xt = 0.
    "v_dpm_solver_sde": dict(sampler="dpm_solver_sde", prediction="v"),
    "x0_consistency": dict(sampler="consistency", prediction="x0"),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STEPS = [0, NUM_STEPS // 2, NUM_STEPS - 1]
# (name, shape): "offset" views start one element into their buffer, so no pointer is 16-byte
# aligned (the CUDA kernel's scalar path); the others are aligned with odd sizes (vector + tail).
LAYOUTS = [
    ("contiguous", (2, 3, 5, 7)),
    ("channels_last", (2, 3, 4, 5)),
    ("offset", (3, 1, 9, 11)),
    ("eps_offset", (2, 1, 6, 6)),  # only eps misaligned: one pointer is enough to leave the vector path
    ("flat_odd", (1003,)),
    ("single", (1,)),
    ("volume", (2, 1, 3, 5, 7)),  # (B, C, D, H, W): 3-D models' x_t
    ("volume_offset", (1, 1, 4, 4, 5)),
]


@pytest.fixture(scope="module", autouse=True)
def extension() -> str:
    return ops.load_extension()


def make_plan(case: str, *, clip: bool = True, device: str = "cpu") -> SamplingPlan:
    kwargs = dict(PLAN_CASES[case])
    schedule = NoiseSchedule(replace(SCHEDULE.config, prediction=kwargs.pop("prediction", "eps")))
    return schedule.make_plan(**kwargs, sampling_steps=NUM_STEPS, clip_denoised=clip, device=device)


def make_tensor(shape, *, dtype, device, layout: str, offset: bool, generator: torch.Generator) -> torch.Tensor:
    """Random N(0, 1.5^2) values (some outside [-1, 1], to exercise the clip) in the given layout."""
    numel = torch.Size(shape).numel()
    values = 1.5 * torch.randn(numel, generator=generator)
    if offset:
        buffer = torch.empty(numel + 1, dtype=dtype, device=device)
        out = buffer[1:].view(shape)  # data pointer one element past an aligned allocation
        out.copy_(values.view(shape))
        return out
    out = values.view(shape).to(device=device, dtype=dtype)
    if layout == "channels_last":
        out = out.contiguous(memory_format=torch.channels_last)
    return out


def make_inputs(
    shape, *, dtype, eps_dtype=None, device="cpu", layout="contiguous", seed=0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_t, eps, noise, previous pred_xstart: (shape) tensors in state dtype (eps: eps_dtype)."""
    g = torch.Generator().manual_seed(seed)

    def make(dt, *, offset):
        return make_tensor(shape, dtype=dt, device=device, layout=layout, offset=offset, generator=g)

    offset = layout in ("offset", "volume_offset")
    x = make(dtype, offset=offset)
    eps = make(eps_dtype or dtype, offset=offset or layout == "eps_offset")
    noise = make(dtype, offset=offset)
    xstart = make(dtype, offset=offset)
    return x, eps, noise, xstart


def check_step_matches_reference(plan: SamplingPlan, i: int, x, eps, noise, xstart) -> None:
    """Run fused_step_ in place on the given tensors and compare with p_step, bit for bit."""
    use_prev = plan.uses_prev_xstart
    noise = noise if plan.noise_steps[i] else None  # as the samplers pass it
    # Reference first: p_step reads the inputs, the op then overwrites x and xstart.
    ref_x, ref_pred = p_step(plan, i, x, eps, noise=noise, prev_xstart=xstart if use_prev else None)
    step = torch.tensor(i, device=x.device)
    ops.fused_step_(
        x,
        eps,
        noise=noise,
        xstart=xstart,
        coefficients=plan.coefficients,
        step=step,
        clip_denoised=plan.clip_denoised,
        use_prev=use_prev,
    )
    torch.testing.assert_close(x, ref_x.to(x.dtype), rtol=0, atol=0, msg=lambda m: f"x_prev at step {i}: {m}")
    torch.testing.assert_close(
        xstart, ref_pred.to(x.dtype), rtol=0, atol=0, msg=lambda m: f"pred_xstart at step {i}: {m}"
    )
    assert int(step) == i  # the op reads the counter, it does not advance it


def check_guided_step_matches_reference(
    plan: SamplingPlan, i: int, x, eps_pair, noise, xstart, *, scale: float
) -> None:
    """The guided fused step (eps_pair: conditional rows, then unconditional) against guided_eps + p_step."""
    use_prev = plan.uses_prev_xstart
    noise = noise if plan.noise_steps[i] else None
    eps = guided_eps(eps_pair, scale)
    ref_x, ref_pred = p_step(plan, i, x, eps, noise=noise, prev_xstart=xstart if use_prev else None)
    ops.fused_step_(
        x,
        eps_pair,
        noise=noise,
        xstart=xstart,
        coefficients=plan.coefficients,
        step=torch.tensor(i, device=x.device),
        clip_denoised=plan.clip_denoised,
        use_prev=use_prev,
        guidance=scale,
    )
    torch.testing.assert_close(x, ref_x.to(x.dtype), rtol=0, atol=0, msg=lambda m: f"guided x_prev at step {i}: {m}")
    torch.testing.assert_close(xstart, ref_pred.to(x.dtype), rtol=0, atol=0, msg=lambda m: f"guided pred_xstart: {m}")


def guided_inputs(shape, *, dtype, eps_dtype=None, device="cpu", layout="contiguous", seed=0):
    """x_t, eps_pair (2B, ...) in x's layout, noise, previous pred_xstart."""
    x, eps_cond, noise, xstart = make_inputs(
        shape, dtype=dtype, eps_dtype=eps_dtype, device=device, layout=layout, seed=seed
    )
    _, eps_uncond, _, _ = make_inputs(
        shape, dtype=dtype, eps_dtype=eps_dtype, device=device, layout=layout, seed=seed + 100
    )
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    eps_pair = torch.cat([eps_cond, eps_uncond]).contiguous(memory_format=memory_format)
    return x, eps_pair, noise, xstart


def check_all_layouts_and_steps(case: str, dtype: torch.dtype, clip: bool, device: str) -> None:
    plan = make_plan(case, clip=clip, device=device)
    for layout, shape in LAYOUTS:
        for i in STEPS:
            x, eps, noise, xstart = make_inputs(shape, dtype=dtype, device=device, layout=layout, seed=i)
            check_step_matches_reference(plan, i, x, eps, noise, xstart)


# ---------------------------------------------------------------------------------------------
# fused_step_ on the CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PLAN_CASES)
def test_fused_step_matches_p_step_bit_for_bit_cpu(case, dtype, clip):
    check_all_layouts_and_steps(case, dtype, clip, "cpu")


@pytest.mark.parametrize("eps_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_step_takes_half_precision_eps_with_float32_state(eps_dtype):
    # The mixed-precision sampler's case: the U-Net's autocast eps, float32 x_t.
    plan = make_plan("dpm_solver")
    x, eps, noise, xstart = make_inputs((2, 3, 8, 8), dtype=torch.float32, eps_dtype=eps_dtype)
    check_step_matches_reference(plan, 5, x, eps, noise, xstart)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PLAN_CASES)
def test_guided_fused_step_matches_guided_eps_and_p_step_bit_for_bit_cpu(case, dtype):
    plan = make_plan(case)
    for layout, shape in [("contiguous", (2, 3, 5, 7)), ("channels_last", (2, 3, 4, 5)), ("single_row", (1, 1, 3, 3))]:
        for i, scale in zip(STEPS, (0.0, 2.5, 7.0)):
            x, eps_pair, noise, xstart = guided_inputs(shape, dtype=dtype, layout=layout, seed=i)
            check_guided_step_matches_reference(plan, i, x, eps_pair, noise, xstart, scale=scale)


def test_guided_fused_step_takes_half_precision_eps_with_float32_state():
    plan = make_plan("ddim_eta0")
    x, eps_pair, noise, xstart = guided_inputs((2, 3, 8, 8), dtype=torch.float32, eps_dtype=torch.bfloat16)
    check_guided_step_matches_reference(plan, 4, x, eps_pair, noise, xstart, scale=3.0)


def test_guided_fused_step_refuses_an_eps_that_is_not_two_halves():
    plan = make_plan("ddim_eta0")
    x, eps_pair, _, xstart = guided_inputs((2, 1, 4, 4), dtype=torch.float32)
    args = dict(
        noise=None,
        xstart=xstart,
        coefficients=plan.coefficients,
        step=torch.tensor(0),
        clip_denoised=True,
        use_prev=False,
        guidance=2.0,
    )
    with pytest.raises(RuntimeError, match="2B rows"):
        ops.fused_step_(x, eps_pair[:3], **args)
    every_other_row = torch.cat([eps_pair, eps_pair], dim=1)[:, :1]  # (4, 1, 4, 4), rows 32 elements apart
    with pytest.raises(RuntimeError, match="memory layout"):
        ops.fused_step_(x, every_other_row, **args)


def test_fused_step_without_xstart_updates_only_x():
    plan = make_plan("ddpm")
    x, eps, noise, _ = make_inputs((2, 3, 8, 8), dtype=torch.float32)
    ref_x, _ = p_step(plan, 3, x, eps, noise=noise)
    ops.fused_step_(
        x,
        eps,
        noise=noise,
        xstart=None,
        coefficients=plan.coefficients,
        step=torch.tensor(3),
        clip_denoised=True,
        use_prev=False,
    )
    torch.testing.assert_close(x, ref_x, rtol=0, atol=0)


def test_fused_step_propagates_nan_like_the_reference():
    plan = make_plan("ddim_eta0")
    x, eps, _, xstart = make_inputs((4, 4), dtype=torch.float32)
    eps[1, 2] = float("nan")
    ref_x, ref_pred = p_step(plan, 0, x, eps)
    ops.fused_step_(
        x,
        eps,
        noise=None,
        xstart=xstart,
        coefficients=plan.coefficients,
        step=torch.tensor(0),
        clip_denoised=True,
        use_prev=False,
    )
    assert torch.isnan(ref_x[1, 2]) and torch.isnan(ref_pred[1, 2])  # the clamp keeps NaN
    torch.testing.assert_close(x, ref_x, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(xstart, ref_pred, rtol=0, atol=0, equal_nan=True)


def test_fused_step_handles_empty_tensors():
    """A zero-sample batch is a no-op (no launch over an empty grid); the op still steps a real batch after it."""
    plan = make_plan("ddpm")
    x, xstart = torch.empty(0, 3, 4, 4), torch.empty(0, 3, 4, 4)
    ops.fused_step_(
        x,
        x.clone(),
        noise=torch.empty(0, 3, 4, 4),
        xstart=xstart,
        coefficients=plan.coefficients,
        step=torch.tensor(0),
        clip_denoised=plan.clip_denoised,
        use_prev=False,
    )
    assert x.shape == xstart.shape == (0, 3, 4, 4)
    check_step_matches_reference(plan, 0, *make_inputs((1, 3, 4, 4), dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# gather_timestep_
# ---------------------------------------------------------------------------------------------


def check_gather_timestep(device: str) -> None:
    plan = make_plan("ddim_eta0", device=device)
    t = torch.full((5,), -1, dtype=torch.int64, device=device)
    for i in STEPS:
        step = torch.tensor(i, device=device)
        ops.gather_timestep_(t, timesteps=plan.timesteps, step=step)
        assert torch.equal(t, plan.timesteps[i].expand(5))


def test_gather_timestep_fills_the_batch_with_the_steps_timestep_cpu():
    check_gather_timestep("cpu")


# ---------------------------------------------------------------------------------------------
# Argument checks (TORCH_CHECK -> RuntimeError)
# ---------------------------------------------------------------------------------------------


def _fused_args(**overrides):
    plan = make_plan("dpm_solver")
    x, eps, noise, xstart = make_inputs((2, 3, 4, 4), dtype=torch.float32)
    args = dict(
        x=x,
        eps=eps,
        noise=noise,
        xstart=xstart,
        coefficients=plan.coefficients,
        step=torch.tensor(1),
        clip_denoised=True,
        use_prev=True,
    )
    args.update({k: (v(args) if callable(v) else v) for k, v in overrides.items()})
    return args


FUSED_STEP_ERRORS = {
    "eps_shape": (dict(eps=lambda a: a["eps"][:1]), "shape"),
    "x_float64": (dict(x=lambda a: a["x"].double(), eps=lambda a: a["eps"].double()), "float32, float16 or bfloat16"),
    "eps_int": (dict(eps=lambda a: a["eps"].int()), "float32, float16 or bfloat16"),
    "x_not_dense": (dict(x=lambda a: torch.randn(2, 3, 4, 8)[..., ::2]), "dense"),
    "eps_other_layout": (dict(eps=lambda a: a["eps"].contiguous(memory_format=torch.channels_last)), "memory layout"),
    "noise_dtype": (dict(noise=lambda a: a["noise"].half()), "noise must have x's dtype"),
    "xstart_dtype": (dict(xstart=lambda a: a["xstart"].bfloat16()), "xstart must have x's dtype"),
    "xstart_is_x": (dict(xstart=lambda a: a["x"]), "single memory location"),
    "eps_is_x": (dict(eps=lambda a: a["x"]), "single memory location"),
    "use_prev_without_xstart": (dict(xstart=None), "use_prev"),
    "coefficients_columns": (dict(coefficients=lambda a: a["coefficients"][:, :6]), r"\(S, 7\)"),
    "coefficients_float64": (dict(coefficients=lambda a: a["coefficients"].double()), "float32"),
    "coefficients_strided": (dict(coefficients=lambda a: a["coefficients"].t().contiguous().t()), "contiguous"),
    "step_float": (dict(step=torch.tensor(1.0)), "int64"),
    "step_two_elements": (dict(step=torch.tensor([1, 2])), "one element"),
    "step_past_the_end": (dict(step=torch.tensor(NUM_STEPS)), "out of range"),
    "step_negative": (dict(step=torch.tensor(-1)), "out of range"),
}


@pytest.mark.parametrize("name", FUSED_STEP_ERRORS)
def test_fused_step_rejects_bad_arguments(name):
    overrides, message = FUSED_STEP_ERRORS[name]
    args = _fused_args(**overrides)
    x, eps = args.pop("x"), args.pop("eps")
    with pytest.raises(RuntimeError, match=message):
        ops.fused_step_(x, eps, **args)


GATHER_ERRORS = {
    "t_int32": (dict(t=torch.zeros(3, dtype=torch.int32)), "int64"),
    "t_2d": (dict(t=torch.zeros(3, 1, dtype=torch.int64)), r"\(B,\)"),
    "timesteps_2d": (dict(timesteps=torch.zeros(4, 1, dtype=torch.int64)), r"\(S,\)"),
    "step_past_the_end": (dict(step=torch.tensor(4)), "out of range"),
}


@pytest.mark.parametrize("name", GATHER_ERRORS)
def test_gather_timestep_rejects_bad_arguments(name):
    overrides, message = GATHER_ERRORS[name]
    args = dict(t=torch.zeros(3, dtype=torch.int64), timesteps=torch.arange(4), step=torch.tensor(0)) | overrides
    with pytest.raises(RuntimeError, match=message):
        ops.gather_timestep_(args["t"], timesteps=args["timesteps"], step=args["step"])


# ---------------------------------------------------------------------------------------------
# opcheck and torch.compile
# ---------------------------------------------------------------------------------------------


def opcheck_samples(device: str):
    plan = make_plan("dpm_solver", device=device)
    for dtype, with_noise, with_xstart in [
        (torch.float32, True, True),
        (torch.bfloat16, False, True),
        (torch.float16, True, False),
    ]:
        x, eps, noise, xstart = make_inputs((2, 3, 5, 5), dtype=dtype, device=device)
        yield (
            torch.ops.diffusion_kernels.fused_step_,
            (
                x,
                eps,
                noise if with_noise else None,
                xstart if with_xstart else None,
                plan.coefficients,
                torch.tensor(2, device=device),
            ),
            dict(clip_denoised=True, use_prev=with_xstart),
        )
    x, eps_pair, noise, xstart = guided_inputs((2, 3, 5, 5), dtype=torch.float32, device=device)
    yield (
        torch.ops.diffusion_kernels.fused_step_,
        (x, eps_pair, noise, xstart, plan.coefficients, torch.tensor(2, device=device)),
        dict(clip_denoised=True, use_prev=True, guidance=3.0),
    )
    t = torch.zeros(4, dtype=torch.int64, device=device)
    yield torch.ops.diffusion_kernels.gather_timestep_, (t, plan.timesteps, torch.tensor(3, device=device)), {}


def test_opcheck_cpu():
    for op, args, kwargs in opcheck_samples("cpu"):
        torch.library.opcheck(op, args, kwargs)


def test_ops_trace_under_torch_compile():
    plan = make_plan("dpm_solver")

    def two_steps(x, eps, xstart, t, step):
        for _ in range(2):
            ops.gather_timestep_(t, timesteps=plan.timesteps, step=step)
            ops.fused_step_(
                x,
                eps,
                noise=None,
                xstart=xstart,
                coefficients=plan.coefficients,
                step=step,
                clip_denoised=True,
                use_prev=True,
            )
            step.add_(1)
        return x + 0, t + 0

    compiled = torch.compile(two_steps, backend="aot_eager", fullgraph=True)
    x, eps, _, xstart = make_inputs((2, 3, 4, 4), dtype=torch.float32)
    eager_args = [x.clone(), eps, xstart.clone(), torch.zeros(2, dtype=torch.int64), torch.tensor(1)]
    compiled_args = [x.clone(), eps, xstart.clone(), torch.zeros(2, dtype=torch.int64), torch.tensor(1)]
    for expected, actual in zip(two_steps(*eager_args), compiled(*compiled_args)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert int(compiled_args[-1]) == 3


# ---------------------------------------------------------------------------------------------
# CUDA kernels
# ---------------------------------------------------------------------------------------------


def _require_cuda_kernels() -> None:
    if not ops.has_cuda_kernels():
        pytest.fail(f"the extension was built without CUDA kernels; rebuild it: {BUILD_COMMAND}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PLAN_CASES)
def test_fused_step_matches_p_step_bit_for_bit_cuda(case, dtype):
    _require_cuda_kernels()
    for clip in (True, False):
        check_all_layouts_and_steps(case, dtype, clip, "cuda")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PLAN_CASES)
def test_guided_fused_step_matches_guided_eps_and_p_step_bit_for_bit_cuda(case, dtype):
    _require_cuda_kernels()
    plan = make_plan(case, device="cuda")
    # (4, 3, 6, 10): 720 elements per half, vectorized; (3, 1, 5, 7): 105, the scalar tail too.
    for layout, shape in [("contiguous", (4, 3, 6, 10)), ("contiguous", (3, 1, 5, 7)), ("channels_last", (2, 3, 4, 8))]:
        for i, scale in zip(STEPS, (0.0, 2.5, 7.0)):
            x, eps_pair, noise, xstart = guided_inputs(shape, dtype=dtype, device="cuda", layout=layout, seed=i)
            check_guided_step_matches_reference(plan, i, x, eps_pair, noise, xstart, scale=scale)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("state_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps_dtype", DTYPES, ids=str)
def test_every_dtype_pair_cuda(state_dtype, eps_dtype):
    _require_cuda_kernels()
    plan = make_plan("dpm_solver", device="cuda")
    for layout, shape in [("contiguous", (3, 3, 17, 19)), ("offset", (3, 3, 17, 19)), ("eps_offset", (2, 5, 7, 9))]:
        x, eps, noise, xstart = make_inputs(shape, dtype=state_dtype, eps_dtype=eps_dtype, device="cuda", layout=layout)
        check_step_matches_reference(plan, 7, x, eps, noise, xstart)


@pytest.mark.gpu
@requires_gpu
def test_large_tensor_grid_strides_cuda():
    # 5M + 3 elements: more vectors than the grid has threads, plus a 3-element tail.
    _require_cuda_kernels()
    plan = make_plan("ddpm", device="cuda")
    x, eps, noise, xstart = make_inputs((5_000_003,), dtype=torch.float32, device="cuda")
    check_step_matches_reference(plan, 4, x, eps, noise, xstart)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("on_cpu", ["coefficients", "step", "eps"])
def test_tensors_on_another_device_are_rejected_cuda(on_cpu):
    _require_cuda_kernels()
    plan = make_plan("ddpm", device="cuda")
    x, eps, noise, _ = make_inputs((2, 3, 4, 4), dtype=torch.float32, device="cuda")
    args = dict(eps=eps, coefficients=plan.coefficients, step=torch.tensor(0, device="cuda"))
    args[on_cpu] = args[on_cpu].cpu()
    with pytest.raises(RuntimeError, match="on cpu but"):
        ops.fused_step_(
            x,
            args["eps"],
            noise=noise,
            xstart=None,
            coefficients=args["coefficients"],
            step=args["step"],
            clip_denoised=True,
            use_prev=False,
        )


@pytest.mark.gpu
@requires_gpu
def test_gather_timestep_cuda():
    _require_cuda_kernels()
    check_gather_timestep("cuda")


@pytest.mark.gpu
@requires_gpu
def test_opcheck_cuda():
    _require_cuda_kernels()
    for op, args, kwargs in opcheck_samples("cuda"):
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", ["ddpm", "dpm_solver"])
def test_captured_graph_replays_every_step_like_the_reference_cuda(case):
    # One graph (gather t, fused step, advance the counter) replayed S times == the p_step loop.
    _require_cuda_kernels()
    plan = make_plan(case, device="cuda")
    shape = (4, 3, 16, 16)
    x0, eps, noise, _ = make_inputs(shape, dtype=torch.float32, device="cuda")
    x, xstart = x0.clone(), torch.zeros(shape, device="cuda")
    t = torch.zeros(shape[0], dtype=torch.int64, device="cuda")
    step = torch.zeros((), dtype=torch.int64, device="cuda")

    def one_step():
        ops.gather_timestep_(t, timesteps=plan.timesteps, step=step)
        ops.fused_step_(
            x,
            eps,
            noise=noise,
            xstart=xstart,
            coefficients=plan.coefficients,
            step=step,
            clip_denoised=True,
            use_prev=plan.uses_prev_xstart,
        )
        step.add_(1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        one_step()  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_step()
    x.copy_(x0)
    xstart.zero_()
    step.zero_()
    for i in range(plan.num_steps):
        graph.replay()
        assert torch.equal(t, plan.timesteps[i].expand_as(t))  # sync: this replay gathered t_i

    ref, prev = x0.clone(), None
    for i in range(plan.num_steps):
        ref, prev = p_step(plan, i, ref, eps, noise=noise, prev_xstart=prev if plan.uses_prev_xstart else None)
    assert int(step) == plan.num_steps
    torch.testing.assert_close(x, ref, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# group_norm_act: GroupNorm + scale/shift + SiLU in one pass (the fused U-Net's op)
# ---------------------------------------------------------------------------------------------


def reference_group_norm_act(
    x, weight, bias, *, groups, eps=1e-5, x2=None, x_bias=None, scale=None, shift=None, silu=True
):
    """The op in float64 PyTorch: concatenate, add the convolution bias, F.group_norm, modulate, SiLU."""
    spatial = (1,) * (x.dim() - 2)
    v = x.double() + (x_bias.double().view(1, -1, *spatial) if x_bias is not None else 0)
    if x2 is not None:
        v = torch.cat([v, x2.double()], dim=1)
    y = torch.nn.functional.group_norm(v, groups, weight.double(), bias.double(), eps)
    if scale is not None:
        y = y * (1 + scale.double().view(*scale.shape, *spatial)) + shift.double().view(*shift.shape, *spatial)
    return torch.nn.functional.silu(y) if silu else y


def group_norm_case(
    shape,
    *,
    c2=0,
    groups,
    dtype=torch.float32,
    layout="contiguous",
    offset=0.0,
    modulate=True,
    x_bias=True,
    device="cpu",
    seed=0,
):
    """Inputs of group_norm_act: x (and x2 with c2 channels) of ``shape``, parameters for C = C1 + c2."""
    g = torch.Generator().manual_seed(seed)
    b, c1, *spatial = shape
    c = c1 + c2

    def tensor(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device)

    def laid_out(t):
        t = t.to(dtype)
        if layout == "channels_last":
            return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
        return t

    args = dict(
        x=laid_out(tensor(*shape) * 2 + offset),
        weight=1 + tensor(c, scale=0.3),
        bias=tensor(c, scale=0.3),
        groups=groups,
        x2=laid_out(tensor(b, c2, *spatial) - offset) if c2 else None,
        x_bias=tensor(c1) if x_bias else None,
    )
    if modulate:
        args.update(scale=tensor(b, c, scale=0.5), shift=tensor(b, c, scale=0.5))
    return args


GROUP_NORM_CASES = {
    "2-D, 32 channels in 8 groups": dict(shape=(3, 32, 6, 6), groups=8),
    "a group of 600 elements (more than the 256 partial sums)": dict(shape=(2, 24, 10, 10), groups=4),
    "a group of 4 elements (fewer than the partial sums)": dict(shape=(2, 4, 2, 2), groups=4),
    "channels-last": dict(shape=(2, 16, 5, 7), groups=4, layout="channels_last"),
    "3-D": dict(shape=(2, 8, 3, 4, 5), groups=2),
    "3-D channels-last": dict(shape=(2, 8, 3, 4, 5), groups=4, layout="channels_last"),
    "a skip connection whose groups straddle x and x2": dict(shape=(2, 6, 4, 4), c2=10, groups=4),
    "no modulation, no convolution bias": dict(shape=(2, 8, 4, 4), groups=2, modulate=False, x_bias=False),
    "values far from zero (a one-pass variance would cancel)": dict(shape=(2, 8, 8, 8), groups=4, offset=300.0),
}


@pytest.mark.parametrize("case", GROUP_NORM_CASES)
@pytest.mark.parametrize("silu", [True, False])
def test_group_norm_act_matches_the_float64_reference_cpu(case, silu):
    args = group_norm_case(**GROUP_NORM_CASES[case])
    out = ops.group_norm_act(**args, silu=silu)
    expected = reference_group_norm_act(**args, silu=silu)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last if out.dim() == 4 else torch.channels_last_3d) == (
        GROUP_NORM_CASES[case].get("layout") == "channels_last"
    )  # x's memory format
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_group_norm_act_in_half_precision_rounds_only_its_input_and_output_cpu(dtype):
    args = group_norm_case((2, 16, 6, 6), c2=8, groups=8, dtype=dtype, layout="channels_last")
    out = ops.group_norm_act(**args)
    assert out.dtype == dtype
    expected = reference_group_norm_act(**args)  # from the same rounded inputs, in float64
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=0, atol=2 * torch.finfo(dtype).eps * 8)


def test_group_norm_acts_silu_follows_exp_over_the_whole_float_range_cpu():
    """SiLU through the shared polynomial exp: within a few float32 ulp of float64 from -100 to 100."""
    y = torch.linspace(-100, 100, 200_001).view(1, 1, -1, 1)
    one = torch.ones(1)
    # GroupNorm of one group is y standardized; undo it with weight = std and bias = mean.
    mean, std = y.double().mean(), y.double().var(unbiased=False).add(1e-5).sqrt()
    out = ops.group_norm_act(y, std.float() * one, mean.float() * one, groups=1)
    reference = reference_group_norm_act(y, std.float() * one, mean.float() * one, groups=1)
    # atol: the de-standardization's own float32 rounding where y crosses 0 (measured 1e-8).
    torch.testing.assert_close(out.double(), reference, rtol=4e-6, atol=2e-8)
    assert torch.isnan(ops.group_norm_act(torch.full((1, 1, 2, 1), float("nan")), one, one * 0, groups=1)).all()


def test_group_norm_acts_silu_is_right_past_exps_clamp_and_at_the_infinities_cpu():
    """exp_rn clamps its argument to [-104, 100]: SiLU stays within float rounding of float64 beyond that (exp
    overflowing to inf, underflowing to 0) and around the clamp's edges, an infinite input gives inf (or NaN at -inf, as
    y * sigmoid(y) does),
    and a NaN stays a NaN."""
    values = torch.cat(
        [torch.linspace(-300, 300, 60_001), torch.tensor([-104.5, -103.5, -87.5, 88.7, 88.73, 99.9, 100.1])]
    )
    specials = torch.tensor([float("inf"), -float("inf"), float("nan")])
    v = torch.cat([values, specials])
    n = v.numel()
    # Each sample: one group of two positions, +1 and -1; with scale = -1 the output before SiLU is shift exactly.
    x = torch.tensor([1.0, -1.0]).repeat(n).view(n, 1, 2, 1)
    out = ops.group_norm_act(x, torch.ones(1), torch.zeros(1), groups=1, scale=-torch.ones(n, 1), shift=v.view(n, 1))[
        :, 0, 0, 0
    ]
    reference = torch.nn.functional.silu(values.double())
    got = out[: values.numel()].double()
    # Below y = -88.7, 1 + exp(-y) overflows and y / inf is -0 where SiLU is -2.6e-37 or less: so is PyTorch's.
    large = reference.abs() > 1e-30
    torch.testing.assert_close(got[large], reference[large], rtol=1e-6, atol=0)
    assert (got[~large].abs() <= 1e-30).all()
    assert out[-3] == float("inf") and torch.isnan(out[-2]) and torch.isnan(out[-1])


@pytest.mark.parametrize(
    "case",
    [
        dict(shape=(3, 32, 9, 9), groups=8),  # 4 channels a group, 324 elements: the partial sums wrap around
        dict(shape=(2, 12, 6, 6), c2=20, groups=16),  # a skip connection, groups of 2 straddling x and x2
        dict(shape=(2, 16, 3, 4, 5), groups=2, modulate=False),  # 3-D, 8 channels a group
        dict(
            shape=(2, 24, 12, 12), groups=8
        ),  # 3 channels a group, 432 elements: 255 partials, each group its own zero-padded tree
        dict(shape=(2, 32, 7, 7), groups=4, dtype=torch.bfloat16),
    ],
)
def test_group_norm_act_cpu_twin_computes_one_order_whatever_the_layout(case):
    """Channels-last inputs take the CPU twin's row-wise loop, contiguous ones its gathering loop: both must
    produce the fixed reduction order of diffusion_kernels.h, so the same values agree bit for bit."""
    contiguous = group_norm_case(**case)
    channels_last = group_norm_case(**case, layout="channels_last")
    a = ops.group_norm_act(**contiguous, silu=True)
    b = ops.group_norm_act(**channels_last, silu=True)
    assert b.is_contiguous(memory_format=torch.channels_last if b.dim() == 4 else torch.channels_last_3d)
    torch.testing.assert_close(b.contiguous(), a, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_group_norm_act_reads_scale_and_shift_from_a_wider_table_or_one_expanded_row(layout):
    """The fused U-Net hands each block its columns of one (B, D) projection table, or one (1, D) row of a
    per-step table expanded over the batch: the same values as contiguous (B, C) tensors, bit for bit."""
    args = group_norm_case((3, 16, 5, 5), groups=4, layout=layout)
    table = torch.randn(3, 40)
    scale, shift = table[:, 4:20], table[:, 20:36]  # (3, 16) views, row stride 40
    expected = ops.group_norm_act(**(args | dict(scale=scale.contiguous(), shift=shift.contiguous())))
    torch.testing.assert_close(ops.group_norm_act(**(args | dict(scale=scale, shift=shift))), expected, rtol=0, atol=0)
    row = torch.randn(1, 32)
    scale, shift = row[:, :16].expand(3, -1), row[:, 16:].expand(3, -1)  # row stride 0
    expected = ops.group_norm_act(**(args | dict(scale=scale.contiguous(), shift=shift.contiguous())))
    torch.testing.assert_close(ops.group_norm_act(**(args | dict(scale=scale, shift=shift))), expected, rtol=0, atol=0)


def test_group_norm_act_handles_an_empty_batch_cpu():
    args = group_norm_case((0, 8, 4, 4), groups=2)
    assert ops.group_norm_act(**args).shape == (0, 8, 4, 4)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(groups=3), "do not split into 3 groups"),
        (dict(weight=torch.ones(7)), "weight must be a contiguous [8] tensor"),
        (dict(scale=None), "scale and shift go together"),
        (dict(scale=torch.ones(8, 2).t()), "scale must be a (2, 8) tensor with dense rows"),
        (dict(x_bias=torch.ones(8, dtype=torch.float64)), "x_bias must be float32"),
        (dict(x2=torch.zeros(2, 4, 5, 5)), "x2 must have x's batch and spatial sizes"),
        (dict(x=torch.zeros(2, 8, 4, 4, dtype=torch.int64)), "x must be float32, float16 or bfloat16"),
        (dict(x=torch.zeros(2, 8, 8, 8)[:, :, ::2, ::2]), "spatial dimensions must be dense"),
    ],
)
def test_group_norm_act_rejects_bad_arguments(change, message):
    args = group_norm_case((2, 8, 4, 4), groups=2) | change
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.group_norm_act(**args)


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_the_built_library_inlines_exp_rn_into_every_loop():
    """exp_rn is forced inline (diffusion_kernels.h): a caller that called it instead stayed a scalar loop, which
    made the norm's SiLU without scale and shift, and with it the CPU runner, several times slower."""
    origin = importlib.util.find_spec(EXTENSION_NAME).origin if ops.load_extension() == "compiled" else None
    if origin is None:
        pytest.skip("the extension was JIT-compiled: no library file to read")
    symbols = subprocess.run(["nm", "-C", origin], capture_output=True, text=True, check=True).stdout
    assert "exp_rn" not in symbols


def test_group_norm_act_opcheck_cpu():
    for case in ("a skip connection whose groups straddle x and x2", "channels-last", "3-D"):
        args = group_norm_case(**GROUP_NORM_CASES[case])
        x, weight, bias, groups = args.pop("x"), args.pop("weight"), args.pop("bias"), args.pop("groups")
        positional = (x, args.get("x2"), weight, bias, args.get("x_bias"), args.get("scale"), args.get("shift"))
        torch.library.opcheck(
            torch.ops.diffusion_kernels.group_norm_act, positional, dict(groups=groups, eps=1e-5, silu=True)
        )


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", GROUP_NORM_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_group_norm_act_cuda_kernel_equals_its_cpu_twin_bit_for_bit(case, dtype):
    _require_cuda_kernels()
    args = group_norm_case(**GROUP_NORM_CASES[case], dtype=dtype)
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    torch.testing.assert_close(ops.group_norm_act(**on_gpu).cpu(), ops.group_norm_act(**args), rtol=0, atol=0)


GROUP_NORM_CHUNK_CASES = {  # the runner's shapes and the kernel's edges, channels-last as the runner lays them out
    "the small U-Net's 128 channels at 28x28 (4 per group, values kept in registers)": dict(
        shape=(4, 128, 28, 28), groups=32, layout="channels_last"
    ),
    "64 channels at 48x48 (2 per group; past the registers, read again)": dict(
        shape=(2, 64, 48, 48), groups=32, layout="channels_last"
    ),
    "3 channels per group (255 partial sums)": dict(shape=(2, 96, 8, 8), groups=32, layout="channels_last"),
    "a skip connection across the chunk": dict(shape=(2, 64, 14, 14), c2=64, groups=32, layout="channels_last"),
    "512 channels in one group (more than the partial sums)": dict(shape=(1, 512, 3, 3), groups=1),
    "NCHW": dict(shape=(3, 64, 7, 7), groups=16),
    "a skip of 192 channels (6 per group: 252 partial sums)": dict(
        shape=(2, 128, 14, 14), c2=64, groups=32, layout="channels_last"
    ),
    "3-D channels-last, 8 channels per group": dict(shape=(2, 64, 4, 6, 6), groups=8, layout="channels_last"),
    "no modulation, no convolution bias": dict(
        shape=(2, 64, 7, 7), groups=32, layout="channels_last", modulate=False, x_bias=False
    ),
    "a skip whose x has 12 channels (a bf16 vector would straddle x and x2)": dict(
        shape=(2, 12, 6, 6), c2=52, groups=32, layout="channels_last"
    ),
}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", GROUP_NORM_CHUNK_CASES)
@pytest.mark.parametrize("chunk", ["1", "2", "4", "8", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["rows", "chunk"])
def test_group_norm_act_cuda_kernel_equals_its_cpu_twin_for_any_groups_per_block(
    monkeypatch, case, chunk, dtype, kernel
):
    """Whichever kernel runs (the rows kernel by default, DIFFUSION_KERNELS_GN_KERNEL=chunk the chunk kernel) and
    however many groups a block normalizes (DIFFUSION_KERNELS_GN_CHUNK; both read at launch), the sums run in the
    twin's one order: the same bits."""
    _require_cuda_kernels()
    if kernel == "rows":
        monkeypatch.delenv("DIFFUSION_KERNELS_GN_KERNEL", raising=False)
    else:
        monkeypatch.setenv("DIFFUSION_KERNELS_GN_KERNEL", "chunk")
    if chunk == "auto":
        monkeypatch.delenv("DIFFUSION_KERNELS_GN_CHUNK", raising=False)
    else:
        monkeypatch.setenv("DIFFUSION_KERNELS_GN_CHUNK", chunk)
    args = group_norm_case(**GROUP_NORM_CHUNK_CASES[case], dtype=dtype)
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    for silu in (True, False):
        expected = ops.group_norm_act(**args, silu=silu)
        torch.testing.assert_close(ops.group_norm_act(**on_gpu, silu=silu).cpu(), expected, rtol=0, atol=0)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(
    "case, kernel",
    [
        ("the small U-Net's 128 channels at 28x28 (4 per group, values kept in registers)", "rows_kernel"),
        ("a skip of 192 channels (6 per group: 252 partial sums)", "rows_kernel"),
        ("NCHW", "chunk_kernel"),
        ("512 channels in one group (more than the partial sums)", "group_norm_act_kernel"),
    ],
)
def test_group_norm_act_runs_the_rows_kernel_on_aligned_channels_last_rows(monkeypatch, case, kernel):
    """By default the runner's layout (channels-last bf16, 16-byte rows) gets the rows kernel and other layouts the
    kernels before it; DIFFUSION_KERNELS_GN_KERNEL=chunk gives it the chunk kernel."""
    _require_cuda_kernels()
    monkeypatch.delenv("DIFFUSION_KERNELS_GN_KERNEL", raising=False)
    args = group_norm_case(**GROUP_NORM_CHUNK_CASES[case], dtype=torch.bfloat16, device="cuda")

    def launched() -> list[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            ops.group_norm_act(**args)
            torch.cuda.synchronize()
        on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return [e.name for e in on_gpu if "group_norm_act" in e.name]  # the kernels (not the operator's CPU event)

    names = launched()
    assert len(names) == 1 and kernel in names[0], names
    if kernel == "rows_kernel":
        monkeypatch.setenv("DIFFUSION_KERNELS_GN_KERNEL", "chunk")
        names = launched()
        assert len(names) == 1 and "chunk_kernel" in names[0], names


# ---------------------------------------------------------------------------------------------
# bias_add_: a convolution's bias and the residual stream, added in place (the GPU runner's)
# ---------------------------------------------------------------------------------------------

BIAS_ADD_CASES = {  # (batch, channels, residual channels (None: no residual; a pair: [x, x2]), spatial)
    "bias only": (2, 16, None, (5, 7)),
    "an identity skip": (3, 64, (64,), (6, 6)),
    "an identity skip on [x, x2]": (2, 48, (32, 16), (4, 4)),
    "channel counts that no vector divides": (2, 12, (7, 5), (3, 5)),
    "one output channel (conv_out)": (2, 1, None, (8, 8)),
    "3-D": (2, 16, (16,), (3, 4, 5)),
}


def bias_add_case(batch, channels, residuals, spatial, *, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last if len(spatial) == 2 else torch.channels_last_3d

    def tensor(c):
        t = torch.randn(batch, c, *spatial, generator=g) * 3
        return t.to(dtype).contiguous(memory_format=fmt).to(device)

    h = tensor(channels)
    bias = torch.randn(channels, generator=g).to(device)
    parts = [tensor(c) for c in residuals] if residuals else []
    return h, bias, (parts + [None, None])[:2]


@pytest.mark.parametrize("case", BIAS_ADD_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_bias_add_is_the_float_sum_rounded_once_cpu(case, dtype):
    h, bias, (r1, r2) = bias_add_case(*BIAS_ADD_CASES[case], dtype=dtype)
    expected = h.float() + bias.view(1, -1, *(1,) * (h.dim() - 2))
    if r1 is not None:
        expected = expected + (r1.float() if r2 is None else torch.cat([r1.float(), r2.float()], 1))
    out = ops.bias_add_(h, bias, residual=r1, residual2=r2)
    assert out is h and h.dtype == dtype and h.is_contiguous(memory_format=od_channels_last(h))
    torch.testing.assert_close(h, expected.to(dtype), rtol=0, atol=0)  # two float32 sums, one rounding


def od_channels_last(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h, b, r: (h.contiguous(), b, r), "dense channels-last"),
        (lambda h, b, r: (h, b[:-1], r), "bias must be a contiguous float32"),
        (lambda h, b, r: (h, b.double(), r), "bias must be a contiguous float32"),
        (lambda h, b, r: (h, b, r[:, :-1].contiguous(memory_format=torch.channels_last)), "channels are not h's"),
        (lambda h, b, r: (h, b, r.half()), "must have h's dtype"),
        (lambda h, b, r: (h, b, h), "must not overlap h"),
    ],
)
def test_bias_add_rejects_bad_arguments(change, message):
    h, bias, (r1, _) = bias_add_case(*BIAS_ADD_CASES["an identity skip"])
    h, bias, r1 = change(h, bias, r1)
    with pytest.raises(RuntimeError, match=message):
        ops.bias_add_(h, bias, residual=r1)


def test_bias_add_opcheck_cpu():
    for case in ("bias only", "an identity skip on [x, x2]"):
        h, bias, (r1, r2) = bias_add_case(*BIAS_ADD_CASES[case])
        torch.library.opcheck(torch.ops.diffusion_kernels.bias_add_, (h, bias, r1, r2))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", BIAS_ADD_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_bias_add_cuda_kernel_equals_its_cpu_twin_bit_for_bit(case, dtype):
    _require_cuda_kernels()
    h, bias, (r1, r2) = bias_add_case(*BIAS_ADD_CASES[case], dtype=dtype)
    on_gpu = [None if t is None else t.cuda() for t in (h, bias, r1, r2)]
    ops.bias_add_(on_gpu[0], on_gpu[1], residual=on_gpu[2], residual2=on_gpu[3])
    ops.bias_add_(h, bias, residual=r1, residual2=r2)
    torch.testing.assert_close(on_gpu[0].cpu(), h, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# conv3x3_winograd: a 3x3 convolution on the CPU in Winograd's F(2x2, 3x3) or F(4x4, 3x3) (the fused U-Net's)
# ---------------------------------------------------------------------------------------------

WINOGRAD_CASES = {  # (batch, Cin, Cout, H, W)
    "even sizes": (2, 16, 16, 6, 6),
    "odd sizes (tiles past the last row and column)": (1, 32, 48, 5, 7),
    "one pixel, 80 output channels (64 + a 16-channel tail)": (3, 16, 80, 1, 1),
    "150 tiles (several blocks and a partial one)": (5, 16, 32, 9, 11),
    "384 channels in and out (blocks of 18 tiles, to stay in cache)": (2, 256, 128, 7, 9),
    "256 channels in and out over 130 tiles (blocks of 48 where the threads allow: U is 4 MiB)": (2, 256, 256, 10, 26),
}


def winograd_case(batch, cin, cout, h, w, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cin, h, w, generator=g).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(cout, cin, 3, 3, generator=g) / (9 * cin) ** 0.5
    return x, weight, torch.randn(cout, generator=g)


# The largest error against float64 for each output tile, and its ratio to oneDNN's direct convolution's: F(2x2, 3x3)'s
# transforms are additions (the rounding is the GEMMs'); F(4x4, 3x3)'s scale by up to 8, so its bounds are looser.
WINOGRAD_ERROR = {2: (2e-6, 2), 4: (2e-5, 10)}


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """The ops run on this many threads: with two, their blocks of tiles split between the threads and the weight
    gradient comes in two partial sums (the suite's workers run one thread otherwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", WINOGRAD_CASES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("tile", [2, 4])
def test_conv3x3_winograd_is_conv2d_with_padding_1_in_float64_cpu(case, with_bias, tile, threads):
    x, weight, bias = winograd_case(*WINOGRAD_CASES[case])
    bias = bias if with_bias else None
    out = ops.conv3x3_winograd(x, ops.winograd_weight(weight, tile=tile), bias)
    expected = torch.nn.functional.conv2d(
        x.double(), weight.double(), None if bias is None else bias.double(), padding=1
    )
    direct = torch.nn.functional.conv2d(x, weight, bias, padding=1)
    assert (
        out.shape == expected.shape
        and out.dtype == torch.float32
        and out.is_contiguous(memory_format=torch.channels_last)
    )
    error = (out.double() - expected).abs().max().item() / expected.abs().max().item()
    bound, times_onednn = WINOGRAD_ERROR[tile]
    assert error < bound, error
    assert error <= times_onednn * (direct.double() - expected).abs().max().item() / expected.abs().max().item() + 1e-7


@pytest.mark.parametrize("case", WINOGRAD_CASES)
@pytest.mark.parametrize("tile", [2, 4])
def test_conv3x3_winograd_weight_grad_gives_the_kernels_gradient_in_float64_cpu(case, tile, threads):
    x, weight, _ = winograd_case(*WINOGRAD_CASES[case])
    dy = weight_grad_dy(x, weight)
    dU = ops.conv3x3_winograd_weight_grad(x, dy, tile=tile)  # (products, Cin, Cout)
    G = torch.tensor(ops.WINOGRAD_G[tile], dtype=torch.float64)
    dg = torch.einsum("ai,abco,bj->ocij", G, dU.double().view(G.shape[0], G.shape[0], *dU.shape[1:]), G)
    g = weight.double().requires_grad_()  # the reference: float64 autograd of the direct convolution
    torch.nn.functional.conv2d(x.double(), g, padding=1).mul(dy.double()).sum().backward()
    error = (dg - g.grad).abs().max().item() / g.grad.abs().max().item()
    assert error < WINOGRAD_ERROR[tile][0], error


@pytest.mark.parametrize("case", WINOGRAD_CASES)
def test_conv3x3_winograd_upsampling_is_conv2d_of_the_nearest_2x_upsampled_input_in_float64_cpu(case):
    """upsample=True: every output phase's 2x2 kernel in F(2x2, 2x2), written where the phase lands."""
    x, weight, bias = winograd_case(*WINOGRAD_CASES[case])
    out = ops.conv3x3_winograd(x, ops.winograd_weight(weight, upsample=True), bias, upsample=True)
    upsampled = torch.nn.functional.interpolate(x.double(), scale_factor=2.0, mode="nearest")
    expected = torch.nn.functional.conv2d(upsampled, weight.double(), bias.double(), padding=1)
    assert out.shape == expected.shape and out.is_contiguous(memory_format=torch.channels_last)
    error = (out.double() - expected).abs().max().item() / expected.abs().max().item()
    assert error < 2e-6, error  # measured 8e-8 to 7e-7


@pytest.mark.parametrize("case", WINOGRAD_CASES)
@pytest.mark.parametrize("upsample", [False, True])
def test_conv3x3_winograd_in_bf16_is_as_close_to_float64_as_onednns_bf16_convolution_cpu(case, upsample):
    """A bfloat16 x: transforms and sums in float32, V and U rounded to bf16 once (the GEMMs on AVX512-BF16's dot
    product where the CPU has it, plain C++ elsewhere), the output rounded to bf16; about as close to float64 as
    oneDNN's direct bf16 convolution of the same bf16 input (measured 0.7-1.8x its error, on AVX512-BF16 and in
    plain C++ alike)."""
    x, weight, bias = winograd_case(*WINOGRAD_CASES[case])
    x = x.bfloat16()  # the input both start from
    pairs = ops.winograd_weight(weight, upsample=upsample, dtype=torch.bfloat16)
    out = ops.conv3x3_winograd(x, pairs, bias, upsample=upsample)
    source = torch.nn.functional.interpolate(x.double(), scale_factor=2.0) if upsample else x.double()
    expected = torch.nn.functional.conv2d(source, weight.double(), bias.double(), padding=1)
    onednn = torch.nn.functional.conv2d(
        torch.nn.functional.interpolate(x, scale_factor=2.0) if upsample else x,
        weight.bfloat16(),
        bias.bfloat16(),
        padding=1,
    )
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    assert out.is_contiguous(memory_format=torch.channels_last)

    def error(a: torch.Tensor) -> float:
        return ((a.double() - expected).norm() / expected.norm()).item()

    assert error(out) < 1e-2 and error(out) < 2.5 * error(onednn), (error(out), error(onednn))


def test_winograd_weight_in_bf16_pairs_input_channels():
    """(P, Cin, Cout) float32 -> (P, Cin / 2, Cout, 2) bfloat16: channels 2c and 2c + 1 side by side."""
    _, weight, _ = winograd_case(1, 32, 16, 4, 4)
    u, pairs = ops.winograd_weight(weight), ops.winograd_weight(weight, dtype=torch.bfloat16)
    assert pairs.shape == (16, 16, 16, 2) and pairs.dtype == torch.bfloat16 and pairs.is_contiguous()
    assert torch.equal(pairs[:, 3, :, 0], u[:, 6, :].bfloat16())
    assert torch.equal(pairs[:, 3, :, 1], u[:, 7, :].bfloat16())


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(x=torch.zeros(2, 16, 4, 4)), "x must be a channels-last float32"),
        (
            dict(x=torch.zeros(2, 16, 4, 4, dtype=torch.float64).contiguous(memory_format=torch.channels_last)),
            "x must be a channels-last float32",
        ),
        (dict(weight=torch.zeros(9, 16, 16)), "weight must be the contiguous float32 (16, Cin=16, Cout)"),
        (
            dict(upsample=True),
            "weight must be the contiguous float32 (36, Cin=16, Cout) transform of winograd_weight(..., upsample=True)",
        ),
        (dict(weight=torch.zeros(16, 16, 24)), "multiples of 16, got Cin=16, Cout=24"),
        (
            dict(
                x=torch.zeros(2, 16, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last),
                weight=torch.zeros(36, 16, 16, dtype=torch.float64),
            ),
            "for a bfloat16 x, weight must be the contiguous bfloat16 (16, Cin/2=8, Cout, 2)",
        ),
        (dict(bias=torch.zeros(8)), "bias must be a contiguous float32 (16,) tensor"),
        (
            dict(
                x=torch.zeros(2, 16, 4, 4, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last),
                weight=torch.zeros(16, 16, 16, dtype=torch.bfloat16),
            ),
            "for a bfloat16 x, weight must be the contiguous bfloat16 (16, Cin/2=8, Cout, 2) transform of "
            "winograd_weight(..., dtype=torch.bfloat16), or its float32 (16, Cin=16, Cout) one (the mixed path)",
        ),
    ],
)
def test_conv3x3_winograd_rejects_bad_arguments(change, message):
    args = (
        dict(
            x=torch.zeros(2, 16, 4, 4).contiguous(memory_format=torch.channels_last),
            weight=torch.zeros(16, 16, 16),
            bias=torch.zeros(16),
        )
        | change
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.conv3x3_winograd(**args)


def test_conv3x3_winograd_opcheck_cpu():
    x, weight, bias = winograd_case(*WINOGRAD_CASES["odd sizes (tiles past the last row and column)"])
    for b in (bias, None):
        torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_winograd, (x, ops.winograd_weight(weight), b))
    up = ops.winograd_weight(weight, upsample=True)
    torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_winograd, (x, up, bias), dict(upsample=True))
    pairs = ops.winograd_weight(weight, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_winograd, (x.bfloat16(), pairs, bias))
    tile4 = ops.winograd_weight(weight, tile=4)
    torch.library.opcheck(torch.ops.diffusion_kernels.conv3x3_winograd, (x, tile4, bias))
    grad = torch.ops.diffusion_kernels.conv3x3_winograd_weight_grad
    torch.library.opcheck(grad, (x, weight_grad_dy(x, weight)), dict(tile=4))


@pytest.mark.parametrize(
    "kwargs", [dict(tile=3), dict(tile=4, upsample=True), dict(tile=4, dtype=torch.bfloat16)], ids=str
)
def test_winograd_weight_refuses_a_tile_it_has_no_algorithm_for(kwargs):
    with pytest.raises(ValueError, match="tile="):
        ops.winograd_weight(torch.zeros(16, 16, 3, 3), **kwargs)


AVX2_OUTPUTS = """
import sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from test_diffusion_kernels import WINOGRAD_CASES, weight_grad_dy, winograd_case
from ddpm.kernels import ops
outputs = {{}}
for case, sizes in WINOGRAD_CASES.items():
    x, weight, bias = winograd_case(*sizes)
    for upsample in (False, True):
        u = ops.winograd_weight(weight, upsample=upsample)
        outputs[case, upsample] = ops.conv3x3_winograd(x, u, bias, upsample=upsample)
    outputs[case, "tile 4"] = ops.conv3x3_winograd(x, ops.winograd_weight(weight, tile=4), bias)
    dy = weight_grad_dy(x, weight)
    for tile in (2, 4):
        outputs[case, "weight grad", tile] = ops.conv3x3_winograd_weight_grad(x, dy, tile=tile)
        xb, dyb = x.bfloat16(), dy.bfloat16()  # the mixed path: bf16 activations, float32 between
        outputs[case, "mixed", tile] = ops.conv3x3_winograd(xb, ops.winograd_weight(weight, tile=tile), bias)
        outputs[case, "mixed weight grad", tile] = ops.conv3x3_winograd_weight_grad(xb, dyb, tile=tile)
torch.save(outputs, {out!r})
"""


def weight_grad_dy(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A gradient of conv3x3_winograd's output for the weight-gradient op: (B, Cout, H, W), channels-last, seeded."""
    shape = (x.shape[0], weight.shape[0], *x.shape[2:])
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return dy.contiguous(memory_format=torch.channels_last)


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="the CPU has no AVX2 and FMA"
)
def test_conv3x3_winograd_blocked_for_avx2_registers_gives_the_avx512_kernels_bits_cpu(tmp_path):
    """A CPU with AVX2 but no AVX-512 runs its own GEMMs, blocked for 16 registers of 8 floats (DDPM_KERNELS_ISA=avx2
    runs them on any AVX2 CPU): the same sums in the same order with the same fused multiply-adds, and the same
    transforms, so its outputs are this process's kernels' bit for bit, plain, upsampling and in F(4x4, 3x3), and the
    weight gradient's too, on float32 and on the mixed path's bf16 activations."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    script = AVX2_OUTPUTS.format(root=str(ROOT), tests=str(ROOT / "tests"), out=str(tmp_path / "avx2.pt"))
    env = {**os.environ, "DDPM_KERNELS_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    avx2 = torch.load(tmp_path / "avx2.pt")
    for case, sizes in WINOGRAD_CASES.items():
        x, weight, bias = winograd_case(*sizes)
        for upsample in (False, True):
            mine = ops.conv3x3_winograd(x, ops.winograd_weight(weight, upsample=upsample), bias, upsample=upsample)
            assert torch.equal(avx2[case, upsample], mine), (case, upsample)
        mine = ops.conv3x3_winograd(x, ops.winograd_weight(weight, tile=4), bias)
        assert torch.equal(avx2[case, "tile 4"], mine), (case, "tile 4")
        for tile in (2, 4):
            mine = ops.conv3x3_winograd_weight_grad(x, weight_grad_dy(x, weight), tile=tile)
            assert torch.equal(avx2[case, "weight grad", tile], mine), (case, "weight grad", tile)
            xb, dyb = x.bfloat16(), weight_grad_dy(x, weight).bfloat16()
            mine = ops.conv3x3_winograd(xb, ops.winograd_weight(weight, tile=tile), bias)
            assert torch.equal(avx2[case, "mixed", tile], mine), (case, "mixed", tile)
            mine = ops.conv3x3_winograd_weight_grad(xb, dyb, tile=tile)
            assert torch.equal(avx2[case, "mixed weight grad", tile], mine), (case, "mixed weight grad", tile)


def test_conv3x3_winograd_handles_an_empty_batch_cpu():
    x, weight, bias = winograd_case(0, 16, 32, 4, 4)
    for tile in (2, 4):
        assert ops.conv3x3_winograd(x, ops.winograd_weight(weight, tile=tile), bias).shape == (0, 32, 4, 4)
        dU = ops.conv3x3_winograd_weight_grad(x, weight_grad_dy(x, weight), tile=tile)
        assert dU.shape == ((tile + 2) ** 2, 16, 32) and not dU.any()
