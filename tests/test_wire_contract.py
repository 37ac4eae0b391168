"""The wire format is exactly the contract of proto/CONTRACT.md (docs/architecture.md#wire-protocol).

TGI's message table (its section 3) is parsed out of that file; our compiled descriptors must match
it field by field, and a client generated from nothing but that table must drive
`python -m engine serve`.
Every extension of ours (section 4), the status codes (5) and the limits (6) must be listed there as
the proto and engine/wire/contract.py have them, so that the page cannot drift from the code.
"""

import json
import re
import runpy
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from engine import batch as eb
from engine.errors import CapacityError, InvalidRequestError, UnwarmedShapeError
from engine.serving.server import ServerConfig
from engine.wire import contract as wire_contract
from engine.wire import convert
from engine.wire import generate_pb2 as pb
from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_server import (
    REPO,
    BackgroundServer,
    short_socket_dir,
    start_cli_server,
    stop_cli_server,
    text_request,
    wait_until_serving,
)

CONTRACT = Path(__file__).parents[1] / "proto" / "CONTRACT.md"
FieldProto = descriptor_pb2.FieldDescriptorProto


@dataclass(frozen=True)
class Field:
    name: str
    number: int
    label: str  # "", "optional" or "repeated"
    type: str  # a scalar type name, or a message or enum name of the package
    oneof: str | None = None


@dataclass
class Contract:
    package: str
    service: str
    rpcs: list[str]
    messages: dict[str, list[Field]] = field(default_factory=dict)
    enums: dict[str, list[tuple[str, int]]] = field(default_factory=dict)


def parse_contract(text: str) -> Contract:
    section = text[text.index("## 3.") : text.index("## 4.")]
    contract = Contract(
        package=re.search(r"`package ([\w.]+);`", section)[1],
        service=re.search(r"`service (\w+)`", section)[1],
        rpcs=[name.strip() for name in re.search(r"RPCs `([^`]+)`", section)[1].split(",")],
    )
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if (
            not line.startswith("|")
            or len(cells) != 2
            or cells[0] == "message"
            or set(cells[0]) <= {"-"}
        ):
            continue
        names, spec = cells
        if names.startswith("enum "):
            contract.enums[names.removeprefix("enum ")] = [
                (n, int(v)) for n, v in re.findall(r"(\w+)=(\d+)", spec)
            ]
        elif " / " in names:  # "A / B | fields of A / fields of B"
            for name, fields in zip(names.split(" / "), spec.split(" / "), strict=True):
                contract.messages[name] = parse_fields(fields)
        else:  # "A, B | fields shared by both"
            for name in names.split(", "):
                contract.messages[name] = parse_fields(spec)
    return contract


def parse_fields(spec: str) -> list[Field]:
    if spec == "empty":
        return []
    oneof = re.fullmatch(r"oneof (\w+) \{ (.*) \}", spec)
    if oneof:
        return [replace(f, oneof=oneof[1]) for f in parse_fields(oneof[2])]
    fields = []
    for item in spec.split(";"):
        match = re.fullmatch(r"(\w+)=(\d+) (?:(optional|repeated) )?(\w+)", item.strip())
        assert match, f"{CONTRACT.name}: cannot read the field {item!r}"
        fields.append(Field(match[1], int(match[2]), match[3] or "", match[4]))
    return fields


@pytest.fixture(scope="module")
def contract() -> Contract:
    # A missing table fails: the only client built independently of our stubs must never silently not run.
    assert CONTRACT.is_file(), f"no contract to check against: {CONTRACT} is missing"
    return parse_contract(CONTRACT.read_text())


# bucketserve's own fields (proto/CONTRACT.md section 4): numbered from 1000 so they never meet a
# TGI field; a TGI shard skips them as unknown fields, and a TGI router leaves them at defaults that
# change nothing. They are the only mechanism of our extensions: none travels as gRPC metadata.
EXTENSION_FROM = 1000
TRACEPARENTS = "map<uint64, string>"
BUCKETSERVE_EXTENSIONS = {
    ("NextTokenChooserParameters", Field("presence_penalty", 1000, "", "float")),
    ("NextTokenChooserParameters", Field("logit_bias_ids", 1001, "repeated", "uint32")),
    ("NextTokenChooserParameters", Field("logit_bias_values", 1002, "repeated", "float")),
    # a reasoning model's block before the answer a grammar constrains (TGI's: the whole text)
    ("NextTokenChooserParameters", Field("grammar_reasoning_start", 1003, "", "string")),
    ("NextTokenChooserParameters", Field("grammar_reasoning_end", 1004, "", "string")),
    ("StoppingCriteriaParameters", Field("min_new_tokens", 1000, "", "uint32")),
    # `n` / `best_of` siblings share one prefill; a shard that skips it computes each prompt itself.
    ("Request", Field("prefill_source", 1000, "optional", "uint64")),
    # resume after a shard restart: the tokens a request generated before it
    ("Request", Field("resume_tokens", 1001, "repeated", "uint32")),
    # tracing: request id -> W3C traceparent of its phase span, for the shard's step spans
    ("PrefillRequest", Field("traceparents", 1000, "", TRACEPARENTS)),
    ("DecodeRequest", Field("traceparents", 1003, "", TRACEPARENTS)),
    # KV blocks allocated on demand: the blocks a running request gets before a Decode
    ("DecodeRequest", Field("grown_request_ids", 1000, "repeated", "uint64")),
    ("DecodeRequest", Field("grown_blocks", 1001, "repeated", "uint32")),
    # decode lookahead: the router decodes the answered batch again next
    ("DecodeRequest", Field("look_ahead", 1002, "", "bool")),
    # pipeline parallelism: the stages (a batch in flight each), the steps' order they keep
    ("InfoResponse", Field("pipeline_stages", 1030, "", "uint32")),
    ("PrefillRequest", Field("step_order", 1030, "", "uint64")),
    ("DecodeRequest", Field("step_order", 1030, "", "uint64")),
    # the shard's serving counters after each step, for the router's /metrics
    ("PrefillResponse", Field("stats", 1000, "", "ServingStats")),
    ("DecodeResponse", Field("stats", 1000, "", "ServingStats")),
}
# Messages of our own: not TGI's, so numbered from 1. The counters are what Shard.serving_stats
# returns (tests/test_server.py checks that a step's stats field equals it).
STATS_COUNTERS = (
    "prefill_real",
    "prefill_padded",
    "decode_real",
    "decode_padded",
    "unwarmed_shapes",
    "prefill_forwards",
    "decode_forwards",
    "copied_prompts",
    "chunked_prompts",
    "prefill_chunks",
    "lookahead_runs",
    "lookahead_steps",
)
PLAN_FIELDS = (
    "plan_prefill_buckets",
    "plan_decode_buckets",
    "warmed_buckets",
    "warmup_buckets",
    "buckets_used",
)
IMAGE_COUNTERS = ("images_encoded", "encoder_ns", "image_cache_hits")  # a vision tower's
GRAPH_COUNTERS = (
    "graph_compiles_warmup",
    "graph_compiles_serving",
    "graph_breaks_warmup",
    "graph_breaks_serving",
    "graph_recompiles_warmup",
    "graph_recompiles_serving",
)
SPEC_COUNTERS = ("spec_steps", "spec_proposed", "spec_accepted", "spec_emitted")
SPEC_RATIOS = ("spec_acceptance_rate", "spec_mean_accepted_length")
EXTENSION_MESSAGES = {
    "ServingStats": [Field(n, i, "", "uint64") for i, n in enumerate(STATS_COUNTERS, 1)]
    + [Field(n, i, "", "uint32") for i, n in enumerate(PLAN_FIELDS, len(STATS_COUNTERS) + 1)]
    + [Field("buckets", 18, "repeated", "BucketUse")]
    + [Field(n, i, "", "uint64") for i, n in enumerate(IMAGE_COUNTERS, 19)]
    + [Field(n, i, "", "uint64") for i, n in enumerate(GRAPH_COUNTERS, 1000)]
    + [Field(n, i, "", "uint64") for i, n in enumerate(SPEC_COUNTERS, 1010)]
    + [Field(n, i, "", "double") for i, n in enumerate(SPEC_RATIOS, 1014)]
    + [Field("spec_k", 1016, "", "uint32")],
    "BucketUse": [
        Field("phase", 1, "", "string"),
        Field("batch_size", 2, "", "uint32"),
        Field("length", 3, "", "uint32"),
        Field("context_blocks", 4, "", "uint32"),
        Field("forwards", 5, "", "uint64"),
        Field("real", 6, "", "uint64"),
        Field("padded", 7, "", "uint64"),
    ],
    # the Embed RPC's (/v1/embeddings)
    "EmbedRequest": [Field("inputs", 1, "repeated", "EmbedInput")],
    "EmbedInput": [
        Field("id", 1, "", "uint64"),
        Field("token_ids", 2, "repeated", "uint32"),
        Field("dimensions", 3, "", "uint32"),
    ],
    "EmbedResponse": [
        Field("embeddings", 1, "repeated", "Embedding"),
        Field("stats", 2, "", "ServingStats"),
    ],
    "Embedding": [Field("request_id", 1, "", "uint64"), Field("values", 2, "repeated", "float")],
}
# RPCs of our own, after TGI's: a TGI router never calls them
EXTENSION_RPCS = ("Embed",)


def test_the_table_was_read_whole(contract):
    assert contract.package == "generate.v3" and contract.service == "TextGenerationService"
    assert len(contract.rpcs) == 8 and set(contract.enums) == {"GrammarType", "FinishReason"}
    for rpc in contract.rpcs:
        assert f"{rpc}Request" in contract.messages and f"{rpc}Response" in contract.messages
    assert len(contract.messages["Request"]) == 14 and contract.messages["InputChunk"][1] == Field(
        "image", 2, "", "Image", "chunk"
    )


# --- (a) our compiled descriptors are the table ------------------------------------------------


def compiled_file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    return proto


def scalar_name(f: FieldProto) -> str:
    return FieldProto.Type.Name(f.type).removeprefix("TYPE_").lower()


def described_field(message: descriptor_pb2.DescriptorProto, f: FieldProto, package: str) -> Field:
    entry = next(
        (
            n
            for n in message.nested_type
            if n.options.map_entry and f.type_name.endswith(f".{message.name}.{n.name}")
        ),
        None,
    )
    if entry is not None:  # a map is a repeated field of a nested entry message: "map<key, value>"
        key, value = (scalar_name(e) for e in entry.field)
        return Field(f.name, f.number, "", f"map<{key}, {value}>")
    if f.type in (FieldProto.TYPE_MESSAGE, FieldProto.TYPE_ENUM):
        assert f.type_name.startswith(f".{package}."), f.type_name
        type_name = f.type_name.rsplit(".", 1)[1]
    else:
        type_name = scalar_name(f)
    label = (
        "repeated"
        if f.label == FieldProto.LABEL_REPEATED
        else "optional"
        if f.proto3_optional
        else ""
    )
    # proto3 `optional` lives in a synthetic oneof of its own: not a oneof of the contract.
    oneof = (
        message.oneof_decl[f.oneof_index].name
        if f.HasField("oneof_index") and not f.proto3_optional
        else None
    )
    return Field(f.name, f.number, label, type_name, oneof)


def test_compiled_messages_match_the_table(contract):
    compiled = compiled_file()
    assert compiled.package == contract.package and compiled.syntax == "proto3"
    messages = compiled_messages(contract.package)
    assert set(messages) == set(contract.messages) | set(EXTENSION_MESSAGES)
    for name, fields in EXTENSION_MESSAGES.items():
        assert messages.pop(name) == fields, name
    extensions = {
        (name, f) for name, fields in messages.items() for f in fields if f.number >= EXTENSION_FROM
    }
    assert extensions == BUCKETSERVE_EXTENSIONS
    for name, fields in contract.messages.items():
        ours = [f for f in messages[name] if f.number < EXTENSION_FROM]
        assert sorted(ours, key=lambda f: f.number) == sorted(fields, key=lambda f: f.number), name
    enums = {e.name: [(v.name, v.number) for v in e.value] for e in compiled.enum_type}
    assert enums == contract.enums


def compiled_messages(package: str) -> dict[str, list[Field]]:
    return {
        m.name: [described_field(m, f, package) for f in m.field]
        for m in compiled_file().message_type
    }


def test_compiled_service_matches_the_table(contract):
    (service,) = compiled_file().service
    assert service.name == contract.service
    methods = [(m.name, m.input_type, m.output_type) for m in service.method]
    prefix = f".{contract.package}."
    rpcs = [*contract.rpcs, *EXTENSION_RPCS]
    assert methods == [(r, f"{prefix}{r}Request", f"{prefix}{r}Response") for r in rpcs]
    assert not any(m.client_streaming or m.server_streaming for m in service.method)


def test_committed_stubs_are_not_stale(tmp_path):
    generate = runpy.run_path(str(REPO / "scripts" / "gen_proto.py"))["generate"]
    for fresh in generate(tmp_path):
        committed = REPO / "engine" / "wire" / fresh.name
        assert committed.is_file(), f"{committed} is missing: run python scripts/gen_proto.py"
        assert without_version_stamps(committed.read_text()) == without_version_stamps(
            fresh.read_text()
        ), f"{committed} is stale against proto/generate.proto: run python scripts/gen_proto.py"


# --- the page lists every extension, status code and limit as the code has them -------------------


def section_rows(text: str, section: str, cells: int) -> list[list[str]]:
    """The rows of the tables in `## {section}.` (up to the next section), less header and rule."""
    start = text.index(f"## {section}.")
    body = text[start : text.index("\n## ", start + 1)]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in body.splitlines()
        if line.startswith("|")
    ]
    rows = [r for r in rows if not set("".join(r)) <= {"-"}]
    assert all(len(r) == cells for r in rows), f"{CONTRACT.name} {section}: not {cells} cells a row"
    return rows[1:]  # the header


def type_text(f: Field) -> str:
    return f"{f.label} {f.type}".strip()


def test_the_page_lists_every_extension_field_with_its_number_and_type(contract):
    compiled = compiled_messages(contract.package)
    ours = sorted(
        (name, f.number, f.name, type_text(f))
        for name, fields in compiled.items()
        for f in fields
        if f.number >= EXTENSION_FROM or name not in contract.messages
    )
    rows = section_rows(CONTRACT.read_text(), "4", 5)
    listed = sorted((message, int(number), name, kind) for message, number, name, kind, _ in rows)
    assert listed == ours  # each field once, none missing, none that the proto does not have
    assert all(meaning for *_, meaning in rows)


def test_the_page_lists_the_status_codes_in_the_order_they_are_checked():
    rows = section_rows(CONTRACT.read_text(), "5", 2)
    mapping = [(kind.__name__, code.name) for kind, code in wire_contract.ERROR_STATUS]
    other = ("any other error", wire_contract.UNEXPECTED_STATUS.name)
    assert [tuple(r) for r in rows] == mapping + [other]


def test_the_page_lists_the_limits_and_the_only_metadata_key():
    text = CONTRACT.read_text()
    limits = {name: value for name, value, _ in section_rows(text, "6", 3)}
    assert limits["MAX_MESSAGE_BYTES"].split()[0] == str(wire_contract.MAX_MESSAGE_BYTES)
    assert limits["RESERVED_BLOCK"] == str(wire_contract.RESERVED_BLOCK)
    keys = {n: getattr(wire_contract, n) for n in dir(wire_contract) if n.endswith("_METADATA_KEY")}
    assert keys == {"TRACEPARENT_METADATA_KEY": "traceparent"}  # extensions are fields instead
    assert re.search(r"`traceparent`\s+\(`TRACEPARENT_METADATA_KEY`\)", text)


def without_version_stamps(source: str) -> str:
    """The stubs less the generator's version numbers, which change with grpcio-tools, not with the proto."""
    source = re.sub(r"# Protobuf Python Version: .*", "", source)
    source = re.sub(r"ValidateProtobufRuntimeVersion\([^)]*\)", "", source)
    return re.sub(r"GRPC_GENERATED_VERSION = .*", "", source)


# --- (b) a client built from nothing but the table drives `python -m engine serve` ---------------


def proto_from_contract(contract: Contract) -> str:
    lines = ['syntax = "proto3";', f"package {contract.package};", f"service {contract.service} {{"]
    lines += [f"  rpc {rpc} ({rpc}Request) returns ({rpc}Response);" for rpc in contract.rpcs]
    lines.append("}")
    for name, values in contract.enums.items():
        lines += [f"enum {name} {{", *[f"  {value} = {number};" for value, number in values], "}"]
    for name, fields in contract.messages.items():
        lines.append(f"message {name} {{")
        lines += [f"  {field_line(f)}" for f in fields if f.oneof is None]
        for oneof in dict.fromkeys(f.oneof for f in fields if f.oneof):
            lines += [
                f"  oneof {oneof} {{",
                *[f"    {field_line(f)}" for f in fields if f.oneof == oneof],
                "  }",
            ]
        lines.append("}")
    return "\n".join(lines) + "\n"


def field_line(f: Field) -> str:
    return " ".join(filter(None, [f.label, f.type, f.name])) + f" = {f.number};"


# Runs in its own interpreter with only the table's modules importable: engine.wire is never loaded,
# and the two sets of generate.v3 descriptors cannot meet in one descriptor pool.
CLIENT = """
import json, sys
import grpc
from google.protobuf import json_format
import generate_pb2 as pb, generate_pb2_grpc as pb_grpc

def MessageToDict(message):  # with the fields at their zero value too (FINISH_REASON_LENGTH is 0)
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)

url, prompts, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
stub = pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(url))
info = stub.Info(pb.InfoRequest(), timeout=60)
warmup = stub.Warmup(pb.WarmupRequest(max_input_tokens=64, max_prefill_tokens=128, max_total_tokens=128), timeout=300)
stopping = pb.StoppingCriteriaParameters(max_new_tokens=new_tokens, ignore_eos_token=True)
parameters = pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
requests = [pb.Request(id=i, inputs=p, parameters=parameters, stopping_parameters=stopping, add_special_tokens=True)
            for i, p in enumerate(prompts)]
response = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=requests, size=len(requests))), timeout=60)
tokens, finished, steps = {}, {}, [MessageToDict(response)]
while True:
    for g in response.generations:
        tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
        if g.HasField("generated_text"):
            finished[g.request_id] = MessageToDict(g.generated_text)
    if not response.HasField("batch"):
        break
    response = stub.Decode(pb.DecodeRequest(batches=[response.batch]), timeout=60)
    steps.append(MessageToDict(response))
print(json.dumps(dict(info=MessageToDict(info), warmup=MessageToDict(warmup), tokens=tokens, finished=finished, steps=steps)))
"""


def compile_contract_client(contract: Contract, out_dir: Path) -> None:
    from grpc_tools import protoc

    (out_dir / "generate.proto").write_text(proto_from_contract(contract))
    args = [
        "protoc",
        f"-I{out_dir}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(out_dir / "generate.proto"),
    ]
    assert protoc.main(args) == 0, proto_from_contract(contract)
    (out_dir / "client.py").write_text(CLIENT)


@pytest.mark.slow
def test_a_client_generated_from_the_table_drives_the_shard(contract, tiny_model_dirs, tmp_path):
    compile_contract_client(contract, tmp_path)
    model_dir, prompts, new_tokens = tiny_model_dirs["llama"], PROMPTS[1:4], 18
    base = short_socket_dir()
    process = start_cli_server(model_dir, base / "shard", env=dict(MAX_BATCH_SIZE="4"))
    expected = dict(
        enumerate(reference_tokens(model_dir, prompts, new_tokens))
    )  # while the server starts
    try:
        wait_until_serving(process, f"unix://{base}/shard-0", base / "shard").close()
        # -E -s: neither PYTHONPATH nor the repository reaches the client, only its own folder.
        client = subprocess.run(
            [
                sys.executable,
                "-E",
                "-s",
                str(tmp_path / "client.py"),
                f"unix://{base}/shard-0",
                json.dumps(prompts),
                str(new_tokens),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
    finally:
        stop_cli_server(process)
        shutil.rmtree(base, ignore_errors=True)
    assert client.returncode == 0, client.stderr
    result = json.loads(client.stdout)
    assert result["info"]["blockSize"] == 16 and result["info"]["deviceType"] == "cpu"
    assert result["warmup"]["maxInputTokens"] == 64 and result["warmup"]["maxTotalTokens"] == 128
    assert {int(k): v for k, v in result["tokens"].items()} == expected
    assert all(
        r["generatedTokens"] == new_tokens and r["finishReason"] == "FINISH_REASON_LENGTH"
        for r in result["finished"].values()
    )
    assert len(result["steps"]) == new_tokens and all(
        int(step["totalNs"]) > 0 for step in result["steps"]
    )


# --- the servicer's side: status codes, unset optionals, one shard call at a time ---------------


class ScriptedShard:
    """The Shard API with scripted answers: records its calls, raises `errors[method]` once, and
    holds a call while `gate` is closed."""

    def __init__(self):
        self.calls, self.errors, self.gate = [], {}, threading.Event()
        self.gate.set()
        self.active = self.most_active = 0
        self.last_timings = eb.StepTimings(forward_ns=3, decode_ns=2, total_ns=5)

    def _enter(self, method: str, *args, **kwargs) -> None:
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            self.calls.append((method, args, kwargs))
            self.gate.wait(timeout=30)
            if method in self.errors:
                raise self.errors.pop(method)
        finally:
            self.active -= 1

    def serving_stats(self):
        return {
            "prefill_real": 0,
            "prefill_padded": 0,
            "decode_real": 0,
            "decode_padded": 0,
            "unwarmed_shapes": 0,
        }

    def info(self):
        self._enter("info")
        return eb.InfoResponse(False, "float32", "scripted", None, 0, False, False, "none", 16)

    def warmup(
        self,
        max_input_tokens=None,
        max_prefill_tokens=None,
        max_total_tokens=None,
        max_batch_size=None,
        batch=None,
    ):
        self._enter(
            "warmup",
            max_input_tokens,
            max_prefill_tokens,
            max_total_tokens,
            max_batch_size,
            batch=batch,
        )
        return eb.WarmupResult(4096, max_input_tokens or 32, max_total_tokens or 64)

    def prefill(self, batch, cached_batch=None):
        self._enter("prefill", batch, cached_batch)
        done = eb.GeneratedText("x", 1, eb.FinishReason.EOS_TOKEN, seed=7)
        return [
            eb.Generation(
                r.id,
                eb.Tokens([5], [-0.5], ["x"], [False]),
                eb.Tokens([7], [-0.25], ["x"], [False]),
                done,
            )
            for r in batch.requests
        ], None

    def decode(self, batches):
        self._enter("decode", batches)
        return [], None

    def filter(self, batch_id, request_ids):
        self._enter("filter", batch_id, request_ids)
        return eb.CachedBatch(batch_id, request_ids, len(request_ids), 0, 0)

    def clear(self, batch_id=None):
        self._enter("clear", batch_id)

    def health(self):
        self._enter("health")


@pytest.fixture
def scripted():
    base = short_socket_dir()
    shard = ScriptedShard()
    server = BackgroundServer(shard, ServerConfig(uds_path=str(base / "s"), max_batch_size=3))
    yield shard, server.stub
    server.close()
    shutil.rmtree(base, ignore_errors=True)


def one_request_prefill(stub):
    return stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=[text_request(1, "hi")])))


@pytest.mark.parametrize(
    "error, code, details",
    [
        (InvalidRequestError("request 1: bad"), grpc.StatusCode.INVALID_ARGUMENT, "request 1: bad"),
        (KeyError("batch 1 not found"), grpc.StatusCode.NOT_FOUND, "batch 1 not found"),
        (CapacityError("KV cache full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "KV cache full"),
        (UnwarmedShapeError("shape (1, 16)"), grpc.StatusCode.FAILED_PRECONDITION, "shape (1, 16)"),
        (
            ZeroDivisionError("division by zero"),
            grpc.StatusCode.INTERNAL,
            "ZeroDivisionError: division by zero",
        ),
    ],
)
def test_shard_errors_become_status_codes_and_serving_goes_on(scripted, error, code, details):
    shard, stub = scripted
    shard.errors["prefill"] = error
    with pytest.raises(grpc.RpcError) as failed:
        one_request_prefill(stub)
    assert (failed.value.code(), failed.value.details()) == (code, details)
    stub.Health(pb.HealthRequest())
    assert [g.request_id for g in one_request_prefill(stub).generations] == [1]


def test_unset_optionals_reach_the_shard_as_none(scripted):
    shard, stub = scripted
    warmed = stub.Warmup(
        pb.WarmupRequest(
            batch=pb.Batch(id=4, requests=[text_request(3, "hi")]), max_prefill_tokens=100
        )
    )
    method, (max_input, max_prefill, max_total, max_batch), kwargs = shard.calls[-1]
    assert (method, max_input, max_prefill, max_total, max_batch) == ("warmup", None, 100, None, 3)
    assert [r.inputs for r in kwargs["batch"].requests] == ["hi"] and kwargs["batch"].id == 4
    assert (
        warmed.HasField("max_supported_total_tokens") and warmed.max_supported_total_tokens == 4096
    )
    stub.ClearCache(pb.ClearCacheRequest())
    stub.ClearCache(pb.ClearCacheRequest(id=0))  # 0 is a batch id like any other, not "all"
    assert shard.calls[-2:] == [("clear", (None,), {}), ("clear", (0,), {})]


def test_the_event_loop_answers_while_the_shard_is_busy_and_shard_calls_never_overlap(scripted):
    shard, stub = scripted
    shard.gate.clear()
    warming = stub.Warmup.future(pb.WarmupRequest(max_prefill_tokens=100))
    queued = stub.Info.future(pb.InfoRequest())
    assert stub.ServiceDiscovery(
        pb.ServiceDiscoveryRequest(), timeout=10
    ).urls  # served while the shard works
    with pytest.raises(grpc.FutureTimeoutError):
        queued.result(timeout=0.5)  # Info waits for the shard's worker
    shard.gate.set()
    assert (
        warming.result(timeout=10).max_input_tokens == 32
        and queued.result(timeout=10).device_type == "scripted"
    )
    assert shard.most_active == 1


def test_generations_keep_their_optional_fields_on_the_wire(scripted):
    _, stub = scripted
    (generation,) = one_request_prefill(stub).generations
    assert generation.HasField("generated_text") and generation.generated_text.HasField("seed")
    assert (generation.generated_text.seed, generation.generated_text.finish_reason) == (
        7,
        pb.FINISH_REASON_EOS_TOKEN,
    )
    assert list(generation.prefill_tokens.ids) == [5] and list(generation.tokens.logprobs) == [
        -0.25
    ]


def test_requests_convert_with_unset_optionals_as_none():
    bare = convert.request_from_pb(pb.Request(id=3, inputs="hi"))
    assert (bare.adapter_id, bare.chunk_len) == (None, None)
    assert (
        bare.parameters == eb.NextTokenChooserParameters()
        and bare.stopping_parameters == eb.StoppingCriteriaParameters()
    )
    full = convert.request_from_pb(
        text_request(3, "hi", adapter_id="", chunk_len=0, blocks=[4], slots=[64])
    )
    assert (full.adapter_id, full.chunk_len, full.blocks, full.slots) == ("", 0, [4], [64])
    assert (
        full.stopping_parameters.ignore_eos_token
        and full.parameters.grammar_type is eb.GrammarType.NONE
    )
    with pytest.raises(InvalidRequestError, match="unknown grammar_type 9"):
        convert.request_from_pb(
            pb.Request(id=3, inputs="hi", parameters=pb.NextTokenChooserParameters(grammar_type=9))
        )
    image_only = pb.Request(
        id=3, input_chunks=pb.Input(chunks=[pb.InputChunk(image=pb.Image(data=b"x"))])
    )
    with pytest.raises(InvalidRequestError, match="image inputs are not supported"):
        convert.request_from_pb(image_only)
    info = convert.info_to_pb(
        eb.InfoResponse(False, "bfloat16", "hpu", None, 0, False, False, "flat", 128)
    )
    assert (
        not info.HasField("window_size")
        and convert.info_to_pb(
            eb.InfoResponse(False, "", "", 4096, 0, False, False, "", 16)
        ).window_size
        == 4096
    )
