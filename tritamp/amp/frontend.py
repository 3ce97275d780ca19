"""``initialize``: every argument, model and optimizer is checked before anything changes;
then the models are cast and patched, the optimizers get their master weights (taken from
the fp32 values the models came with), and the global amp state is replaced."""
import numbers
import weakref

import torch

from tritamp.sharding import any_dtensor, overflow_group

from .model import (check_models, check_params_fp32, convert_network, patch_forward,
                     planned_param_dtypes, register_fp32_state_dict)
from .optimizer import check_param_dtype, process_optimizer, shared_master_message
from .overflow import param_names
from .state import _amp_state, maybe_print
from .properties import (Properties, check_dtype_arg, check_half_dtype,
                         check_opt_level, opt_levels)
from .scaler import LossScaler


def _type_name(value):
    return type(value).__name__


def _as_models(models):
    if isinstance(models, torch.nn.Module):
        return [models], False
    if isinstance(models, list):
        for i, m in enumerate(models):
            if not isinstance(m, torch.nn.Module):
                raise TypeError("models must be either a single model or a list of models; "
                                f"models[{i}] is a {_type_name(m)}, not a torch.nn.Module.")
        return list(models), True
    raise TypeError("models must be either a single model or a list of models; got a "
                    f"{_type_name(models)}. Pass a torch.nn.Module or a list of them.")


def _is_wrapper(o):
    """An optimizer wrapper such as tritamp.parallel.LARC (Apex's LARC does the same):
    not a torch Optimizer itself, it holds one as ``.optim`` and forwards
    ``param_groups``, ``step`` and ``zero_grad`` to it. Recognised by that shape, so amp
    needs no import of the package that defines it."""
    return (not isinstance(o, torch.optim.Optimizer)
            and isinstance(getattr(o, "optim", None), torch.optim.Optimizer)
            and callable(getattr(o, "step", None)) and callable(getattr(o, "zero_grad", None))
            and getattr(o, "param_groups", None) is o.optim.param_groups)


def _is_optimizer(o):
    return isinstance(o, torch.optim.Optimizer) or _is_wrapper(o)


def _refuse_fp16_optimizer(o):
    """Apex's check_optimizers: an FP16_Optimizer (it keeps masters and scales itself)."""
    from ..fp16_utils import FP16_Optimizer  # (fp16_utils imports amp: imported here)
    if isinstance(o, FP16_Optimizer):
        raise RuntimeError("An incoming optimizer is an instance of "
                           "tritamp.fp16_utils.FP16_Optimizer. The optimizer(s) passed to "
                           "amp.initialize() must be bare instances of either ordinary PyTorch "
                           "optimizers, or tritamp's fused optimizers (FP16_Optimizer keeps "
                           "master weights and scales the loss itself: use one or the other).")


def _as_optimizers(optimizers):
    if optimizers is None:
        return [], False
    for o in optimizers if isinstance(optimizers, list) else [optimizers]:
        _refuse_fp16_optimizer(o)
    if _is_optimizer(optimizers):
        return [optimizers], False
    kinds = "torch.optim.Optimizer or tritamp.parallel.LARC instances"
    if isinstance(optimizers, list):
        for i, o in enumerate(optimizers):
            if not _is_optimizer(o):
                raise TypeError("optimizers must be either a single optimizer or a list of "
                                f"optimizers ({kinds}); optimizers[{i}] is a {_type_name(o)}.")
        return list(optimizers), True
    raise TypeError("optimizers must be either a single optimizer or a list of optimizers "
                    f"({kinds}); got a {_type_name(optimizers)}.")


def _check_num_losses(num_losses):
    if isinstance(num_losses, bool) or not isinstance(num_losses, numbers.Integral):
        raise TypeError(f"num_losses must be an int >= 1 (how many losses scale_loss will be "
                        f"given, by loss_id), got {num_losses!r} of type "
                        f"{_type_name(num_losses)}")
    if num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1, got {num_losses!r}; pass "
                         "num_losses=1 for a single loss")
    return int(num_losses)


def _check_verbosity(verbosity):
    if not isinstance(verbosity, numbers.Real):
        raise TypeError(f"verbosity must be an int (0 silences amp's messages, 1 logs them), "
                        f"got {verbosity!r} of type {_type_name(verbosity)}")


def _check_optimizers(optimizers, models, props):
    """What ``process_optimizer`` refuses, checked before anything changes, with each
    parameter's dtype as it will be after the models are cast."""
    seen = {}
    for i, opt in enumerate(optimizers):
        inner = opt.optim if _is_wrapper(opt) else opt
        if hasattr(opt, "_amp_stash") or hasattr(inner, "_amp_stash"):
            raise RuntimeError("A given optimizer should only be passed through amp.initialize "
                               f"once; optimizers[{i}] already was. Create a fresh optimizer "
                               "over the model returned by initialize.")
        if id(inner) in seen:
            raise RuntimeError("A given optimizer should only be passed through amp.initialize "
                               f"once; optimizers[{seen[id(inner)]}] and optimizers[{i}] are "
                               "the same optimizer. Pass each optimizer once.")
        seen[id(inner)] = i
        flag = next((f for f in ("stochastic_rounding", "kahan_summation")
                     if getattr(inner, f, False) is True), None)
        if flag is not None and props.master_weights:
            raise ValueError(
                f"optimizers[{i}] ({type(inner).__name__}) has {flag}=True, which stores bf16 "
                "weights without fp32 masters, but this opt_level keeps fp32 master weights "
                "(master_weights=True); pass master_weights=False (opt_level='O2', "
                "half_dtype=torch.bfloat16) or drop the flag")
    cast = props.cast_model_type
    planned = planned_param_dtypes(models, cast, bool(props.keep_batchnorm_fp32)) if cast else {}
    mastered = {}  # parameters that get an fp32 master: {tensor id: where}
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                where = f"optimizers[{i}].param_groups[{g}]['params'][{j}]"
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"Optimizer's parameters must be floating point tensors; "
                                    f"{where} is a {_type_name(p)}")
                if not p.is_floating_point():
                    raise TypeError(f"Optimizer's parameters must be floating point tensors; "
                                    f"received {p.dtype} at {where} (shape "
                                    f"{tuple(p.shape)}). Leave integer tensors out of the "
                                    "optimizer, e.g. [p for p in model.parameters() if "
                                    "p.is_floating_point()].")
                dtype = planned.get(p, p.dtype)
                cast_note = "" if dtype == p.dtype else \
                    f" (a {p.dtype} model parameter cast to cast_model_type={cast})"
                check_param_dtype(p, dtype, props, where, cast_note)
                if props.master_weights and p.requires_grad and dtype != torch.float32:
                    first = mastered.setdefault(id(p), where)
                    if first is not where:
                        raise ValueError(shared_master_message(p, dtype, first, where))


def _options_lines(props):
    return ["{:22} : {}".format(k, v) for k, v in props.options.items()]


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
               min_loss_scale=None, max_loss_scale=2.**24, half_dtype=torch.float16, *,
               init_scale=2.**16, growth_factor=2., backoff_factor=0.5, growth_interval=2000,
               hysteresis=1, overflow_process_group=None):
    """Prepare models and optimizers for mixed precision, as Apex's ``amp.initialize``.

    Call it after building the model(s) and optimizer(s) and before wrapping the
    model in DistributedDataParallel. Returns the model(s) and optimizer(s) in the shape
    they were given (single object or list). Any property argument that is not None
    overrides the opt level's default; argparse strings ("True", "128.0", "dynamic")
    are accepted.

    Every argument, model and optimizer is checked before anything changes: a call that
    raises leaves the models, the optimizers and amp's global state (verbosity,
    properties, loss scalers) as they were. ``opt_level`` of a type other than ``str``
    raises a TypeError; an unknown string Apex's RuntimeError. With master weights (O2)
    the masters are the fp32 values the model came with, not values rounded through the
    half dtype.

    Beyond Apex: ``half_dtype`` (torch.float16 or torch.bfloat16; with bf16 the default
    loss scale is 1.0), and keyword-only scaler settings ``init_scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``
    (Megatron's: overflows tolerated before a backoff), and ``overflow_process_group``:
    a ``torch.distributed`` process group over which the overflow flag is all-reduced (MAX)
    before every step, so ranks holding different gradients (tensor / pipeline / model
    parallel) skip the same steps. Data parallel needs none: its gradients are already
    all-reduced, so every rank sees the same inf/NaN.
    """
    # -- checks: nothing below changes anything until the line that says so -----------
    check_half_dtype(half_dtype)
    model_list, models_was_list = _as_models(models)
    opt_list, optimizers_was_list = _as_optimizers(optimizers)
    num_losses = _check_num_losses(num_losses)
    _check_verbosity(verbosity)

    if not enabled:
        _amp_state.verbosity = verbosity
        _amp_state.opt_properties = Properties()
        _amp_state.loss_scalers = []
        return _shape(model_list, models_was_list, opt_list, optimizers_was_list)

    check_opt_level(opt_level)
    props = opt_levels[opt_level](Properties(), half_dtype)
    messages = ["Selected optimization level {}".format(opt_levels[opt_level].brief),
                "Defaults for this optimization level are:", *_options_lines(props),
                "Processing user overrides (additional kwargs that are not None)..."]
    if cast_model_type is not None:
        props.cast_model_type = cast_model_type
    if patch_torch_functions is not None:
        props.patch_torch_functions = patch_torch_functions
    if keep_batchnorm_fp32 is not None:
        props.keep_batchnorm_fp32 = keep_batchnorm_fp32
    if master_weights is not None:
        props.master_weights = master_weights
    if loss_scale is not None:
        props.loss_scale = loss_scale
    if cast_model_outputs is not None:
        check_dtype_arg("cast_model_outputs", cast_model_outputs)
    messages += ["After processing overrides, optimization options are:", *_options_lines(props)]

    check_models(model_list)
    check_params_fp32(model_list)
    if len({id(m) for m in model_list}) != len(model_list):
        raise RuntimeError("The same model appears more than once in the list passed to "
                           "amp.initialize; pass each model once.")
    _check_optimizers(opt_list, model_list, props)
    overflow_process_group = _check_sharded(model_list, opt_list, props, opt_level,
                                            overflow_process_group)
    if overflow_process_group is not None:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("overflow_process_group was given but torch.distributed is not "
                               "initialized; call torch.distributed.init_process_group(...) "
                               "before amp.initialize, or leave overflow_process_group=None.")
        if overflow_process_group is dist.GroupMember.NON_GROUP_MEMBER:
            # (what new_group returns on a rank it leaves out)
            raise ValueError(
                f"overflow_process_group: this rank ({dist.get_rank()}) is not a member of "
                "the group (torch.distributed.new_group gives the other ranks "
                "GroupMember.NON_GROUP_MEMBER); amp agrees on overflows over the ranks that "
                "train this model together: pass a group this rank belongs to")
        if not (overflow_process_group is dist.group.WORLD
                or isinstance(overflow_process_group, dist.ProcessGroup)):
            raise TypeError("overflow_process_group must be a torch.distributed process group "
                            "(e.g. torch.distributed.new_group(ranks) or "
                            f"torch.distributed.group.WORLD), got {overflow_process_group!r}")
    # The scalers check their settings as they are built, before anything is changed.
    scalers = [LossScaler(props.loss_scale, init_scale=init_scale, scale_factor=growth_factor,
                          scale_window=growth_interval, min_loss_scale=min_loss_scale,
                          max_loss_scale=max_loss_scale, backoff_factor=backoff_factor,
                          hysteresis=hysteresis, loss_id=i,
                          overflow_process_group=overflow_process_group)
               for i in range(num_losses)]

    # -- everything checked: from here on, change things ----------------------------
    _amp_state.verbosity = verbosity
    for line in messages:
        maybe_print(line, True)

    cast = props.cast_model_type
    # The values the models came with (the tensors themselves, no copy): the casts below
    # give each parameter new storage, and the master weights are taken from these.
    before_cast = {}
    if cast and props.master_weights:
        for model in model_list:
            for p in model.parameters():
                before_cast.setdefault(p, p.data)
    for model in model_list:
        if cast:
            convert_network(model, cast, keep_batchnorm_fp32=bool(props.keep_batchnorm_fp32))
            # (patch_torch_functions with a cast, O1 with cast_model_type=torch.float32
            # say: Apex casts the model and still patches torch's functions)
            patch_forward(model, input_dtype=cast,
                          output_dtype=cast_model_outputs or torch.float32,
                          autocast_dtype=props.half_dtype if props.patch_torch_functions
                          else None)
            register_fp32_state_dict(model)
        elif props.patch_torch_functions:
            # O1: autocast around the forward; half outputs leave the region in fp32, so
            # a loss computed outside runs in fp32 as Apex's patched loss functions did
            # (other outputs as they are; every floating one cast to cast_model_outputs
            # when it is given, as Apex's caster).
            patch_forward(model, autocast_dtype=props.half_dtype,
                          output_dtype=cast_model_outputs or torch.float32,
                          widen_outputs=cast_model_outputs is None)
        elif cast_model_outputs is not None:
            patch_forward(model, output_dtype=cast_model_outputs)
        model._tritamp_initialized = True

    for opt in opt_list:
        process_optimizer(opt, props)
    names = param_names(model_list, opt_list)
    for opt in opt_list:
        opt._amp_stash.param_names = names
    if before_cast:
        _masters_from(opt_list, before_cast)
    del before_cast

    _amp_state.opt_properties = props
    _amp_state.loss_scalers = scalers
    _amp_state.optimizers = weakref.WeakSet(opt_list)
    return _shape(model_list, models_was_list, opt_list, optimizers_was_list)


def _check_sharded(models, optimizers, props, opt_level, overflow_process_group):
    """DTensor parameters (FSDP2's ``fully_shard`` before ``initialize``): O0 and O1 work
    on them; casting the model (O2, O3) or fp32 master weights are refused, FSDP2's own
    ``MixedPrecisionPolicy`` does that part. With a dynamic loss scale the ranks agree on
    the overflow flag over the mesh (unless ``overflow_process_group`` says otherwise).
    Returns the overflow group to use."""
    params = [p for m in models for p in m.parameters()]
    params += [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    if not any_dtensor(params):
        return overflow_process_group
    half_cast = props.cast_model_type not in (None, torch.float32)
    if half_cast or props.master_weights:
        what = (f"opt_level={opt_level!r} casts the model to {props.cast_model_type}"
                if half_cast else "master_weights=True keeps fp32 masters")
        raise RuntimeError(
            f"amp.initialize: {what}, but the model's parameters are DTensors (sharded with "
            "FSDP2's fully_shard). FSDP2 casts sharded parameters itself: give "
            "fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16 "
            "or torch.float16, reduce_dtype=torch.float32)) and keep the fp32 sharded "
            "parameters as the masters, with amp.initialize(..., opt_level='O0', "
            "loss_scale='dynamic') for float16 (or no amp for bfloat16); or use "
            "opt_level='O1' (autocast) on the fp32 sharded model. Nothing was changed.")
    if overflow_process_group is None and props.loss_scale == "dynamic":
        return overflow_group(params)
    return overflow_process_group


@torch.no_grad()
def _masters_from(optimizers, before_cast):
    """Set every master weight to its model parameter's value from before the cast.

    ``process_optimizer`` copies the masters from the cast (half) parameters; an fp32
    checkpoint loaded before ``initialize`` would lose every bit below half precision.
    The half model keeps the value the cast rounded to: the same as rounding the master."""
    for opt in optimizers:
        stash = opt._amp_stash
        for p, master in zip(stash.model_params, stash.masters):
            value = before_cast.get(p)
            if value is not None:
                master.copy_(value)


def _shape(models, models_was_list, optimizers, optimizers_was_list):
    m = models if models_was_list else models[0]
    if optimizers_was_list:
        return m, optimizers
    if not optimizers:
        return m
    return m, optimizers[0]
