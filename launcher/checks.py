"""What is checked before any shard starts. Each failure is one line that names the numbers."""

from __future__ import annotations

import errno
import os
import secrets
import socket
import stat
import tempfile

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class ConfigError(Exception):
    """The launch cannot work as configured; nothing has been started."""


# torch's weight-only products have kernels on these devices only (native_functions.yaml:
# _weight_int8pack_mm on CPU, CUDA, MPS and XPU; _weight_int4pack_mm_for_cpu on CPU)
QUANTIZE_DEVICES = {"int8": ("cpu", "cuda", "xpu"), "int4": ("cpu",)}


def check_placement(quantize: str, device: str, stages: int) -> None:
    """A quantization that no shard of this launch could serve, refused before any starts."""
    devices = QUANTIZE_DEVICES.get(quantize)
    if devices is not None and device not in devices:
        raise ConfigError(
            f"--quantize {quantize} runs on {', '.join(devices)} only, not on --device {device}"
        )
    if quantize != "none" and stages > 1:
        raise ConfigError(f"--quantize {quantize} does not combine with --pipeline-parallel-size")


def split_problem(heads: int, kv_heads: int, num_shard: int) -> str | None:
    """Why the attention heads cannot be split num_shard ways, or None when they can.

    Query heads must divide evenly; KV heads either divide evenly or, when there are fewer of
    them than shards, are replicated, which needs num_shard to be a multiple of them."""
    if heads % num_shard:
        return f"num_attention_heads={heads} is not divisible by {num_shard}"
    if kv_heads % num_shard and num_shard % kv_heads:
        return (
            f"num_key_value_heads={kv_heads} and {num_shard} shards: neither is a multiple of "
            "the other"
        )
    return None


def check_split(model_id: str | None, num_shard: int, what: str = "") -> None:
    """`what`: how the command line made these `num_shard` tensor-parallel ranks (default:
    --num-shard)."""
    # Resolving here also converts a GGUF model once, before N shards would race to convert it.
    # One shard splits nothing and races no other shard: the launcher then never imports torch or
    # transformers, and starts its shard seconds sooner (the shard converts, atomically, if needed).
    if num_shard == 1:
        return
    from engine.config import default_cache_dir
    from engine.weights.loader import read_config, resolve_model_dir

    model_dir = resolve_model_dir(model_id, default_cache_dir())
    config = read_config(model_dir)
    problem = split_problem(config.num_heads, config.num_kv_heads, num_shard)
    if problem:
        raise ConfigError(
            f"{what or f'--num-shard {num_shard}'} cannot split the model in {model_dir}: {problem}"
        )


def check_stages(model_id: str | None, stages: int) -> None:
    """Every pipeline stage needs a layer at least."""
    if stages == 1:
        return
    from engine.config import default_cache_dir
    from engine.weights.loader import read_config, resolve_model_dir

    model_dir = resolve_model_dir(model_id, default_cache_dir())
    layers = read_config(model_dir).num_layers
    if stages > layers:
        raise ConfigError(
            f"--pipeline-parallel-size {stages} is larger than the {layers} layers of the "
            f"model in {model_dir}"
        )


def check_limits(
    max_input: int, max_total: int, max_prefill: int, num_shard: int, chunked: bool = False
) -> None:
    """TGI's launcher refuses these too: a shard would otherwise only fail at the router's Warmup.
    `chunked` (prefix caching on): a prompt beyond the prefill budget is computed in chunks."""
    if num_shard < 1:
        raise ConfigError(f"--num-shard must be at least 1, not {num_shard}")
    if max_input >= max_total:
        raise ConfigError(
            f"--max-input-tokens ({max_input}) must be below --max-total-tokens ({max_total})"
        )
    if max_prefill < max_input and not chunked:
        raise ConfigError(
            f"--max-batch-prefill-tokens ({max_prefill}) must be at least "
            f"--max-input-tokens ({max_input})"
        )


def port_in_use(port: int) -> bool:
    """Whether a TCP listener could not bind `port` on every interface (0.0.0.0 also collides
    with a socket bound to 127.0.0.1 only)."""
    with socket.socket() as probe:
        # Like any server would: a port lingering in TIME_WAIT is free to take.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def check_port(flag: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise ConfigError(f"{flag} {port} is not a TCP port (1-65535)")
    if port_in_use(port):
        raise ConfigError(f"{flag} {port} is already in use on this host")


def pick_free_port(avoid: int) -> int:
    """A port nothing listens on now. Another process may still take it before rank 0 binds it:
    the window is the shards' start-up, and a collision fails the launch loudly, never silently."""
    while True:
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            port = probe.getsockname()[1]
        if port != avoid:
            return port


def unique_socket_base() -> str:
    """Our pid and a random suffix: two launchers on one host never share a socket."""
    return os.path.join(tempfile.gettempdir(), f"bucketserve-{os.getpid()}-{secrets.token_hex(3)}")


def check_socket_base(base: str, num_shard: int) -> None:
    last = f"{base}-{num_shard - 1}"
    if len(os.fsencode(last)) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"socket path {last} is longer than {MAX_SOCKET_PATH} bytes: choose a shorter "
            "--uds-path"
        )
    folder = os.path.dirname(os.path.abspath(base))
    if not os.path.isdir(folder):
        raise ConfigError(f"--uds-path {base}: folder {folder} does not exist")
    for rank in range(num_shard):
        check_socket_free(f"{base}-{rank}")


def check_socket_free(path: str) -> None:
    """A stale socket is fine (the shard replaces it); a live server or a regular file is not ours
    to take."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return  # nobody listens: left behind by a shard that died
    raise ConfigError(
        f"{path} is in use: another server listens on it (another launcher with this --uds-path?)"
    )
