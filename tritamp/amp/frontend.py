"""``initialize``."""
import torch

from ._model import (check_models, check_params_fp32, convert_network, patch_forward,
                     register_fp32_state_dict)
from ._optimizer import process_optimizer
from ._state import _amp_state, maybe_print
from .properties import Properties, check_half_dtype, check_opt_level, opt_levels
from .scaler import LossScaler


def _as_models(models):
    if isinstance(models, torch.nn.Module):
        return [models], False
    if isinstance(models, list) and all(isinstance(m, torch.nn.Module) for m in models):
        return list(models), True
    raise TypeError("models must be either a single model or a list of models.")


def _is_optimizer(o):
    # tritamp.parallel.LARC wraps an optimizer without subclassing one, as in Apex.
    from ..parallel.LARC import LARC
    return isinstance(o, (torch.optim.Optimizer, LARC))


def _as_optimizers(optimizers):
    if optimizers is None:
        return [], False
    if _is_optimizer(optimizers):
        return [optimizers], False
    if isinstance(optimizers, list) and all(_is_optimizer(o) for o in optimizers):
        return list(optimizers), True
    raise TypeError("optimizers must be either a single optimizer or a list of optimizers "
                    "(torch.optim.Optimizer or tritamp.parallel.LARC instances).")


def _print_options(props):
    for k, v in props.options.items():
        maybe_print("{:22} : {}".format(k, v), True)


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

    Beyond Apex: ``half_dtype`` (torch.float16 or torch.bfloat16; with bf16 the default
    loss scale is 1.0), and keyword-only scaler settings ``init_scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``
    (Megatron's: overflows tolerated before a backoff), and ``overflow_process_group``:
    a ``torch.distributed`` process group over which the overflow flag is all-reduced (MAX)
    before every step, so ranks holding different gradients (tensor / pipeline / model
    parallel) skip the same steps. Data parallel needs none: its gradients are already
    all-reduced, so every rank sees the same inf/NaN.
    """
    check_half_dtype(half_dtype)
    model_list, models_was_list = _as_models(models)
    opt_list, optimizers_was_list = _as_optimizers(optimizers)
    if not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1, got {num_losses!r}")

    props = Properties()
    _amp_state.verbosity = verbosity
    if not enabled:
        _amp_state.opt_properties = props
        _amp_state.loss_scalers = []
        return _shape(model_list, models_was_list, opt_list, optimizers_was_list)

    check_opt_level(opt_level)
    props = opt_levels[opt_level](props, half_dtype)
    maybe_print("Selected optimization level {}".format(opt_levels[opt_level].brief), True)
    maybe_print("Defaults for this optimization level are:", True)
    _print_options(props)
    maybe_print("Processing user overrides (additional kwargs that are not None)...", True)
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
    if cast_model_outputs is not None and not (isinstance(cast_model_outputs, torch.dtype)
                                               and cast_model_outputs.is_floating_point):
        raise ValueError(f"cast_model_outputs must be a floating torch.dtype or None, got "
                         f"{cast_model_outputs!r}")
    maybe_print("After processing overrides, optimization options are:", True)
    _print_options(props)

    # Validate everything before touching anything: a refused call changes nothing.
    check_models(model_list)
    check_params_fp32(model_list)
    if len({id(o) for o in opt_list}) != len(opt_list):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize "
                           "once; the same optimizer appears more than once in the list.")
    if len({id(m) for m in model_list}) != len(model_list):
        raise RuntimeError("The same model appears more than once in the list passed to "
                           "amp.initialize; pass each model once.")
    for opt in opt_list:
        if hasattr(opt, "_amp_stash"):
            raise RuntimeError("A given optimizer should only be passed through amp.initialize "
                               "once. Create a fresh optimizer over the model returned by "
                               "initialize.")
    if overflow_process_group is not None:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("overflow_process_group was given but torch.distributed is not "
                               "initialized; call torch.distributed.init_process_group(...) "
                               "before amp.initialize, or leave overflow_process_group=None.")
        if not (overflow_process_group is dist.group.WORLD
                or isinstance(overflow_process_group, dist.ProcessGroup)):
            raise TypeError("overflow_process_group must be a torch.distributed process group "
                            "(e.g. torch.distributed.new_group(ranks) or "
                            f"torch.distributed.group.WORLD), got {overflow_process_group!r}")
    scalers = [LossScaler(props.loss_scale, init_scale=init_scale, scale_factor=growth_factor,
                          scale_window=growth_interval, min_loss_scale=min_loss_scale,
                          max_loss_scale=max_loss_scale, backoff_factor=backoff_factor,
                          hysteresis=hysteresis, loss_id=i,
                          overflow_process_group=overflow_process_group)
               for i in range(num_losses)]

    cast = props.cast_model_type
    for model in model_list:
        if cast:
            if props.keep_batchnorm_fp32:
                convert_network(model, cast, keep_batchnorm_fp32=True)
            else:
                convert_network(model, cast, keep_batchnorm_fp32=False)
            patch_forward(model, input_dtype=cast,
                          output_dtype=cast_model_outputs or torch.float32)
            register_fp32_state_dict(model)
        elif props.patch_torch_functions:
            # O1: autocast around the forward; outputs leave the region in fp32 (or
            # cast_model_outputs), so a loss computed outside runs in fp32 as Apex's
            # patched loss functions did.
            patch_forward(model, autocast_dtype=props.half_dtype,
                          output_dtype=cast_model_outputs or torch.float32)
        elif cast_model_outputs is not None:
            patch_forward(model, output_dtype=cast_model_outputs)
        model._tritamp_initialized = True

    for opt in opt_list:
        process_optimizer(opt, props)

    _amp_state.opt_properties = props
    _amp_state.loss_scalers = scalers
    return _shape(model_list, models_was_list, opt_list, optimizers_was_list)


def _shape(models, models_was_list, optimizers, optimizers_was_list):
    m = models if models_was_list else models[0]
    if optimizers_was_list:
        return m, optimizers
    if not optimizers:
        return m
    return m, optimizers[0]
