"""Generate the Python gRPC stubs of proto/generate.proto into engine/wire/.

    python scripts/gen_proto.py            # regenerate the committed stubs
    python scripts/gen_proto.py OUT_DIR    # generate elsewhere (tests compare the two)

protoc writes `import generate_pb2` into the gRPC module, which only works with engine/wire on
sys.path; the import is rewritten to the package path so `engine.wire.generate_pb2_grpc` imports
`engine.wire.generate_pb2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO = REPO / "proto" / "generate.proto"
PACKAGE_DIR = REPO / "engine" / "wire"
GENERATED = ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py")
BARE_IMPORT = "import generate_pb2 as generate__pb2"
PACKAGE_IMPORT = "from engine.wire import generate_pb2 as generate__pb2"


def generate(out_dir: Path, proto: Path = PROTO) -> list[Path]:
    """Compile `proto` into out_dir with grpc_tools' bundled protoc; returns the files written."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{proto.parent}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto}")
    grpc_module = out_dir / "generate_pb2_grpc.py"
    source = grpc_module.read_text()
    if BARE_IMPORT not in source:
        raise RuntimeError(f"protoc's output changed: {BARE_IMPORT!r} not found in {grpc_module}")
    grpc_module.write_text(source.replace(BARE_IMPORT, PACKAGE_IMPORT))
    return [out_dir / name for name in GENERATED]


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else PACKAGE_DIR
    for path in generate(out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
