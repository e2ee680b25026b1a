# The grader's side of a Python submission, run inside the runner before the submission's module
# (embedded in the grader binary; the Rust side is submission/src/python/shim.rs).
#
# It captures what it uses of torch and of Python before any code of the submission runs, builds
# the submission's tensors from the runner's DLPack capsules (no copies), calls the contract's
# functions, and checks what layer_step returns without running code the submission controls: the
# exact type (no subclass, no lazy object), then shape, dtype, device, layout and contiguity
# through torch's own C-level descriptors, with torch-function dispatch (subclasses and modes) off.
# Only the data pointer and the dtype go back to Rust, which copies the bytes itself.
#
# Every entry returns (error, a, b, c): error "" and three ints, or one paragraph saying what went
# wrong, a shortened traceback included, and a = _UNSUPPORTED where build_layer declined the config
# by raising NotImplementedError (then error is the exception's own text).

import sys
import traceback

_extract_tb = traceback.extract_tb
_format_exception_only = traceback.format_exception_only
_type = type
_tuple = tuple
_TRACEBACK_FRAMES = 4
_MESSAGE_CHARS = 1500
_NotImplementedError = NotImplementedError
_str = str
# The failure kind `a` of an answer whose build_layer declined the config (shim.rs, UNSUPPORTED).
_UNSUPPORTED = 1

# Filled by start(): torch's originals, the submission's module, its handle, its last output.
_t = None
_user = None
_handle = None
_last = None
_ordinal = 0


class Refusal(Exception):
    """A broken contract, said in one sentence (no traceback)."""


class Declined(Exception):
    """build_layer raised NotImplementedError: a config the module does not implement, in its own words."""


def _describe(e):
    if _type(e) is Refusal:
        return str(e)
    text = "".join(_format_exception_only(_type(e), e)).strip()
    frames = [f for f in _extract_tb(e.__traceback__) if not f.filename.startswith("<")]
    if frames:
        shown = " | ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}" for f in frames[-_TRACEBACK_FRAMES:])
        text += f" (traceback, innermost last: {shown})"
    return text[:_MESSAGE_CHARS]


def _unsupported(e):
    """The text of build_layer's NotImplementedError, or a sentence saying it had none."""
    try:
        text = _str(e).strip()
    except BaseException:
        text = ""
    return (text or "build_layer raised NotImplementedError without saying why")[:_MESSAGE_CHARS]


def _entry(what):
    def wrap(function):
        def call(*args):
            try:
                a, b, c = function(*args)
                return ("", a, b, c)
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: the runner must get an answer
                if _type(e) is Declined:
                    return (e.args[0], _UNSUPPORTED, 0, 0)
                return (_describe(e) if _type(e) is Refusal else f"{what} raised {_describe(e)}", 0, 0, 0)
        return call
    return wrap


class _Originals:
    """torch's descriptors and objects as they were before the submission was imported."""

    def __init__(self, torch):
        base = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase  # renamed in torch 2.1
        def attribute(name):
            for klass in base.__mro__:
                if name in klass.__dict__:
                    return klass.__dict__[name]
            raise Refusal(f"torch {torch.__version__} has no Tensor attribute {name}: the grader does not know this torch")
        self.Tensor = torch.Tensor
        self.data_ptr = attribute("data_ptr")
        self.is_contiguous = attribute("is_contiguous")
        self.get_device = attribute("get_device")
        self.shape = attribute("shape").__get__
        self.dtype = attribute("dtype").__get__
        self.layout = attribute("layout").__get__
        self.is_cuda = attribute("is_cuda").__get__
        self.strided = torch.strided
        self.dtypes = {torch.bfloat16: 0, torch.float32: 1}
        self.no_torch_function = torch._C.DisableTorchFunction
        self.from_dlpack = torch.utils.dlpack.from_dlpack
        self.bfloat16 = torch.bfloat16


def _load_torch(setup):
    try:
        import torch
        import torch.utils.dlpack
    except BaseException as e:
        raise Refusal(f"{setup['executable']} cannot import torch: {_describe(e)}")
    if not torch.cuda.is_available():
        raise Refusal(f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees no GPU in this process: "
                      "install a torch built for this machine's CUDA driver")
    if not _ordinal < torch.cuda.device_count():
        raise Refusal(f"torch sees {torch.cuda.device_count()} GPU(s), not device {_ordinal}")
    torch.cuda.set_device(_ordinal)
    return torch


def _import_module(path):
    import importlib.util
    name = path.rsplit("/", 1)[-1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    for function in ("build_layer", "layer_step"):
        if not callable(getattr(module, function, None)):
            raise Refusal(f"{path} has no function {function} once imported: a Python submission defines "
                          "build_layer(weights, kv_cache, cfg, max_seq_len) and layer_step(handle, x, pos)")
    return module


@_entry("importing the submission")
def start(setup_json, ordinal):
    import json
    global _t, _user, _ordinal
    setup = json.loads(setup_json)
    _ordinal = ordinal
    sys.path[:] = setup["path"]
    sys.executable = setup["executable"]
    sys.prefix, sys.exec_prefix = setup["prefix"], setup["exec_prefix"]
    sys.argv = [setup["module"]]
    _t = _Originals(_load_torch(setup))
    _user = _import_module(setup["module"])
    return 0, 0, 0


@_entry("build_layer")
def build(cfg_json, layers, max_seq_len):
    """layers: per layer, its tensors' comma-separated names and their capsules, layer 0's first."""
    import json
    global _handle
    weights, caches = [], []
    for names, capsules in layers:
        tensors = dict(zip(names.split(","), (_t.from_dlpack(c) for c in capsules)))
        caches.append((tensors.pop("k_cache"), tensors.pop("v_cache")))
        weights.append(tensors)
    cfg = json.loads(cfg_json)
    cfg["wdtype"] = _t.bfloat16
    try:
        _handle = _user.build_layer({"layers": weights}, caches, cfg, max_seq_len)
    except _NotImplementedError as e:
        raise Declined(_unsupported(e))
    return 0, 0, 0


@_entry("layer_step")
def step(capsule, pos, batch, d, hidden=None):
    """hidden: a stack's (layers - 1, batch, d) capsule, which layer_step gets as a fourth argument to
    fill; one layer's layer_step is called with three, as the contract always called it."""
    global _last
    _last = None
    x = _t.from_dlpack(capsule)
    if hidden is None:
        out = _user.layer_step(_handle, x, pos)
    else:
        out = _user.layer_step(_handle, x, pos, _t.from_dlpack(hidden))
    # Kept until the next step, so its memory stays allocated while the runner copies it.
    _last = out
    return _check(out, batch, d)


def _check(out, batch, d):
    if _type(out) is not _t.Tensor:
        raise Refusal(f"layer_step returned a {_type(out).__module__}.{_type(out).__qualname__}, not a plain "
                      "torch.Tensor (no subclass, no lazy object): return the (B, d) output tensor itself")
    with _t.no_torch_function():
        shape = _tuple(_t.shape(out))
        dtype = _t.dtype(out)
        if shape != (batch, d):
            raise Refusal(f"layer_step returned a tensor of shape {shape}, not (B, d) = ({batch}, {d})")
        if dtype not in _t.dtypes:
            raise Refusal(f"layer_step returned a {dtype} tensor: x_out is torch.bfloat16 or torch.float32")
        if not _t.is_cuda(out) or _t.get_device(out) != _ordinal:
            raise Refusal(f"layer_step returned a tensor on {'cuda:%d' % _t.get_device(out) if _t.is_cuda(out) else 'the CPU'}"
                          f", not on cuda:{_ordinal} where its inputs are")
        if _t.layout(out) is not _t.strided or not _t.is_contiguous(out):
            raise Refusal("layer_step returned a non-contiguous tensor: return a contiguous one (.contiguous())")
        return _t.data_ptr(out), _t.dtypes[dtype], 0


@_entry("teardown")
def teardown():
    global _handle, _last
    function = getattr(_user, "teardown", None)
    handle, _handle, _last = _handle, None, None
    if callable(function):
        function(handle)
    return 0, 0, 0
