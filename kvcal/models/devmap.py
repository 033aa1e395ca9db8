"""Models split over several devices (`--device-map`): the checks, the placement of kvcal's built-in random models,
and the per-layer device that capture, codecs, caches and step graphs follow.

A model loaded with a device map keeps each decoder layer's weights on one device (accelerate's dispatch: hooks on
the blocks move activations from one device to the next). kvcal never keeps a device of its own for per-layer work:
the device of layer i is where its attention weights are (`layer_device`), so the same code serves one device and
several, for models kvcal loads and for models a user dispatched.

Placement: Hugging Face models load through transformers' own `device_map` (accelerate). kvcal's built-in models
are built in code: the tiny test models are built as without a map (the same seeded weights) on the map's first
device and then dispatched; real shapes (`random-llama-3.1-8b`) are never built whole on one device: their skeleton
is made without memory (meta parameters), accelerate places its blocks, and each block's parameters are allocated
and drawn on their own device, seeded by the module's name (the same weights whatever the split, on one kind of
GPU; not those of the single-device build, which draws all of them from one generator).
"""

from __future__ import annotations

import logging
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch
from transformers import AutoModelForCausalLM

from kvcal.errors import KvcalError

DEVICE_MAP_VALUES = ("auto", "balanced", "sequential", "even")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(GiB|MiB|KiB|GB|MB|KB|B)?", re.IGNORECASE)


def parse_max_memory(text: str | None) -> dict[int, str] | None:
    """`0=20GiB,1=20GiB` -> {0: "20GiB", 1: "20GiB"} (GPU index = size); one line on anything else."""
    if text is None:
        return None
    caps: dict[int, str] = {}
    for part in text.split(","):
        index, sep, size = (s.strip() for s in part.partition("="))
        if not sep or not index.isdigit() or not _SIZE.fullmatch(size):
            raise KvcalError(f"--max-memory '{text}' is malformed: give GPU=SIZE pairs separated by commas, e.g. "
                             "0=20GiB,1=20GiB")
        if int(index) in caps:
            raise KvcalError(f"--max-memory names GPU {index} twice")
        if _bytes(size) <= 0:
            raise KvcalError(f"--max-memory gives GPU {index} no memory ({size})")
        caps[int(index)] = size.replace(" ", "")
    return caps


def _bytes(size: str) -> float:
    number, unit = _SIZE.fullmatch(size.strip()).groups()
    scale = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    return float(number) * scale[(unit or "b").lower()]


def check_device_map(device_map: str | None, max_memory: str | None = None, device: str = "auto",
                     gpus: int | None = None) -> tuple[str | None, dict[int, str] | None]:
    """The command line's --device-map / --max-memory, checked before anything loads: a known value, no --device
    other than the default beside it, CUDA GPUs present, caps for GPUs that exist. Returns (value, caps)."""
    caps = parse_max_memory(max_memory)
    if device_map is None:
        if caps is not None:
            raise KvcalError("--max-memory applies with --device-map only")
        return None, None
    if device_map not in DEVICE_MAP_VALUES:
        raise KvcalError(f"unknown --device-map '{device_map}' ({', '.join(DEVICE_MAP_VALUES)})")
    if device != "auto":
        raise KvcalError(f"--device {device} and --device-map {device_map} both place the model: give one of them")
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if gpus == 0:
        raise KvcalError("--device-map places the model's layers on CUDA GPUs, and this machine has none")
    for index in caps or {}:
        if index >= gpus:
            raise KvcalError(f"--max-memory names GPU {index}, and this machine has {gpus} (0 to {gpus - 1})")
    return device_map, caps


def device_scope(device):
    """The block in which work on `device` runs: CUDA's current device set to it (Triton launches on the current
    device, and torch's current stream is the current device's), nothing elsewhere."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def load_cuda_linalg(devices) -> None:
    """One small CUDA linear-algebra call in the calling thread, before device threads start: torch loads its CUDA
    linalg library on the first such call, and two threads making their first calls at once fail with "lazy wrapper
    should be called at most once" (CommVQ's key EM solves on every GPU at once)."""
    cuda = [d for d in devices if torch.device(d).type == "cuda"]
    if cuda:
        eye = torch.eye(1, dtype=torch.float64, device=cuda[0])
        torch.linalg.solve_ex(eye, eye)


def run_per_device(items: list, device_of, work) -> None:
    """work(item) for every item, the items of one device in their order, those of different devices at once (one
    thread per device: a model split over GPUs trains its layers on every GPU together). Each thread runs in its
    device's scope. A failure, or Ctrl-C in the calling thread, stops the other devices' threads at their next
    check (work gets it as its `stop` keyword: a callable that raises KeyboardInterrupt once a stop is asked), waits
    for them and re-raises the failure (KeyboardInterrupt for Ctrl-C). One device: the items run in the calling
    thread."""
    groups: dict[torch.device, list] = {}
    for item in items:
        groups.setdefault(torch.device(device_of(item)), []).append(item)
    if len(groups) <= 1:
        for item in items:
            with device_scope(device_of(item)):
                work(item, stop=lambda: None)
        return
    load_cuda_linalg(groups)
    halt = threading.Event()

    def stop():
        if halt.is_set():
            raise KeyboardInterrupt

    def run(device, mine):
        try:
            with device_scope(device):
                for item in mine:
                    stop()
                    work(item, stop=stop)
        except BaseException:
            halt.set()
            raise

    errors = []
    with ThreadPoolExecutor(len(groups), thread_name_prefix="kvcal-device") as pool:  # its exit waits for them all
        futures = [pool.submit(run, device, mine) for device, mine in groups.items()]
        for future in futures:
            try:
                future.result()
            except BaseException as err:  # a thread's failure, or Ctrl-C while waiting: the others stop at a check
                halt.set()
                errors.append(err)
    if errors:
        first = next((e for e in errors if not isinstance(e, KeyboardInterrupt)), errors[0])
        raise first


def normalize(device) -> torch.device:
    """torch.device of an accelerate device-map value (a GPU index, 'cuda:1', 'cpu', a torch.device)."""
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def check_placement(device_map: dict) -> None:
    """kvcal runs every layer where its weights are: a map that offloads (disk, or the CPU beside GPUs, where
    accelerate would stream weights in at each call) is refused in one line."""
    devices = {str(v) for v in device_map.values()}
    if "disk" in devices:
        raise KvcalError("the device map offloads layers to disk: they do not fit the GPUs' memory (raise "
                         "--max-memory or use more GPUs); kvcal runs each layer where its weights are")
    kinds = {normalize(v).type for v in device_map.values()}
    if "cpu" in kinds and "cuda" in kinds:
        where = sorted(k for k, v in device_map.items() if normalize(v).type == "cpu")
        raise KvcalError(f"the device map offloads {', '.join(where[:3])}{' ...' if len(where) > 3 else ''} to the "
                         "CPU: the model does not fit the GPUs' memory (raise --max-memory or use more GPUs)")


def loading_kwargs(device_map, max_memory, config=None, dtype=None) -> dict:
    """What transformers' from_pretrained takes for a device map (its own balancing of 'auto', or an explicit map;
    'even' becomes the explicit map of the model's skeleton, built from `config` without memory); {} without one."""
    if device_map is None:
        return {}
    if device_map == "even":
        from accelerate import init_empty_weights  # as in infer_map

        with init_empty_weights(include_buffers=False):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return {"device_map": even_map(skeleton, torch.cuda.device_count(), max_memory)}
    kwargs = {"device_map": device_map}
    if max_memory:
        kwargs["max_memory"] = dict(max_memory)
    return kwargs


def infer_map(model, device_map, max_memory, dtype, gpus: int | None = None) -> dict:
    """An explicit map of `model`'s blocks (decoder layers are never split): a dict is returned as given; 'auto' and
    'balanced' spread the layers over the GPUs by memory (as transformers does for them), 'sequential' fills GPU 0
    first, 'even' puts the same number of layers on each (even_map); --max-memory caps each GPU. `gpus`: how many
    GPUs 'even' spreads over (default: the machine's)."""
    if isinstance(device_map, dict):
        return dict(device_map)
    if device_map == "even":
        return even_map(model, torch.cuda.device_count() if gpus is None else gpus, max_memory)
    # accelerate (here and below): imported only where a device map is placed
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    caps = dict(max_memory) if max_memory else None
    if device_map != "sequential":
        caps = get_balanced_memory(model, max_memory=caps, no_split_module_classes=no_split, dtype=dtype)
    elif caps is None:
        from accelerate.utils import get_max_memory

        caps = get_max_memory()
    if caps is not None:  # the CPU and disk are no places for kvcal's layers (check_placement says so)
        caps = {k: v for k, v in caps.items() if k not in ("cpu", "disk")}
        caps["cpu"] = 0
    return infer_auto_device_map(model, max_memory=caps, no_split_module_classes=no_split, dtype=dtype)


def even_map(model, gpus: int, max_memory: dict | None = None) -> dict:
    """The 'even' map of `model` (a skeleton on meta will do) over GPUs 0..gpus-1: its decoder layers in consecutive
    runs of equal length (the first GPUs take one more where the count does not divide; no more GPUs than layers),
    the blocks before the layers (the embeddings) on the first GPU, those after them (the final norm, the LM head) on
    the last, and an LM head tied to the embeddings with them. Work that runs per layer on every GPU at once (CommVQ's
    key EM and value training) then ends when all GPUs do; accelerate's 'balanced' weighs memory and keeps the first
    GPU lighter (docs/runtime.md). Each GPU's weights are checked against its
    --max-memory cap, else its free memory: a share that does not fit is refused in one line."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or gpus < 1:
        raise KvcalError(f"--device-map even needs CUDA GPUs and a decoder with model.layers ({type(model).__name__})")
    for module in (model, inner):
        if next(module.named_parameters(recurse=False), None) is not None:
            raise KvcalError(f"--device-map even: {type(module).__name__} keeps weights outside its blocks; use "
                             "--device-map auto")
    used = min(gpus, len(layers))
    base, extra = divmod(len(layers), used)
    owners = [g for g in range(used) for _ in range(base + (g < extra))]
    head = model.get_output_embeddings()
    shared = head is not None and head.weight is model.get_input_embeddings().weight  # one tensor for both blocks
    tied = shared or (head is not None and bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False)))
    placement, after = {}, False
    for name, child in inner.named_children():
        if child is layers:
            placement.update({f"model.layers.{i}": owners[i] for i in range(len(layers))})
            after = True
        else:
            placement[f"model.{name}"] = used - 1 if after else 0
    after = False
    for name, child in model.named_children():
        if child is inner:
            after = True
        else:
            placement[name] = 0 if (tied and child is head) or not after else used - 1
    modules = dict(model.named_modules())
    weights = [0] * used
    for block, gpu in placement.items():
        module = modules[block]
        weights[gpu] += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    if shared:  # counted with the embeddings and again with the head
        weights[0] -= head.weight.numel() * head.weight.element_size()
    for gpu, size in enumerate(weights):
        if max_memory and gpu in max_memory:
            cap, what = _bytes(str(max_memory[gpu])), "its --max-memory"
        elif torch.cuda.is_available() and gpu < torch.cuda.device_count():
            cap, what = torch.cuda.mem_get_info(gpu)[0], "its free memory"
        else:
            continue
        if size > cap:
            raise KvcalError(f"--device-map even puts {size / 2**30:.2f} GiB of weights on GPU {gpu}, over {what} "
                             f"({cap / 2**30:.2f} GiB): use more GPUs, or --device-map auto")
    return placement


def dispatch(model, device_map: dict):
    """accelerate's hooks on `model`'s blocks, placed as `device_map` says (every parameter already materialized);
    hooks also when the map names one device, so a map of CPU blocks runs the same bookkeeping (tests)."""
    from accelerate import dispatch_model  # as in infer_map

    check_placement(device_map)
    skip = getattr(model, "_skip_keys_device_placement", None)
    quiet = logging.getLogger("accelerate.big_modeling")  # it calls CPU blocks "offloaded" even where they run
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        # the input's device: the first block's (the embeddings), not whichever device a set yields first
        first = next(iter(device_map.values()))
        dispatch_model(model, device_map=device_map, main_device=first, skip_keys=skip, force_hooks=True)
    finally:
        quiet.setLevel(level)
    model.hf_device_map = dict(device_map)
    return model


def build_split(config, dtype: torch.dtype, device_map, max_memory, seed: int = 0,
                attn_implementation: str = "sdpa"):
    """A random-weight model of `config` placed by `device_map` without ever existing whole on one device: the
    skeleton on meta, then each block's parameters allocated on its device and initialized there (transformers'
    own init of each module) from a generator seeded by (seed, module name)."""
    from accelerate import init_empty_weights  # as in infer_map

    with init_empty_weights(include_buffers=False):  # buffers (RoPE frequencies) keep real values, on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    placement = infer_map(model, device_map, max_memory, dtype)
    check_placement(placement)
    blocks = sorted(placement, key=len, reverse=True)  # the most specific block name that holds a module wins
    devices = sorted({normalize(v) for v in placement.values()}, key=str)
    for name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        block = next((b for b in blocks if b == "" or name == b or name.startswith(b + ".")), None)
        if block is None:
            raise KvcalError(f"the device map places no block that holds {name}")
        device = normalize(placement[block])
        for pname, p in params:
            setattr(module, pname, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                      requires_grad=p.requires_grad))
        with torch.random.fork_rng(devices=[d.index or 0 for d in devices if d.type == "cuda"]):
            torch.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            with torch.no_grad():
                model._init_weights(module)
    return dispatch(model.eval(), placement)


def placement_summary(loaded) -> str:
    """One line: which layers sit on which device, e.g. 'layers 0-13 on cuda:0, 14-31 on cuda:1 (embeddings cuda:0,
    LM head cuda:1)'."""
    runs: list[list] = []  # [device, first, last]
    for i in range(loaded.dims.num_layers):
        device = str(loaded.layer_device(i))
        if runs and runs[-1][0] == device:
            runs[-1][2] = i
        else:
            runs.append([device, i, i])
    parts = [f"{first}-{last} on {device}" if first != last else f"{first} on {device}" for device, first, last in runs]
    head = loaded.model.get_output_embeddings()
    where = f"embeddings {loaded.device}" + ("" if head is None else f", LM head {head.weight.device}")
    return f"layers {', '.join(parts)} ({where})"
