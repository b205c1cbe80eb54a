"""Wire messages and the codec: round trips, typed errors, tensor headers, no pickle."""

from __future__ import annotations

import ast
import enum
import inspect
import types
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from engine.data import wire
from engine.data.codec import (
    Limits,
    MalformedMessage,
    OversizedMessage,
    TensorData,
    UnknownMessage,
    UnsupportedTensor,
    WireCodec,
    check_header,
    contiguous_strides,
    flatten_tensor,
)
from engine.data.wire import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    Message,
    PullRequest,
    RefId,
    TensorHeader,
    TensorRef,
    Transport,
)
from engine.spec.calls import CallHeader

ENGINE_DATA = Path(__file__).resolve().parents[3] / "engine" / "data"
WIRE_PATH_MODULES = ["wire.py", "codec.py", "channel.py", "shm.py", "tensor_store.py", "ref_table.py",
                     "store_memory.py", "server.py", "transport_choice.py", "peer.py", "values.py", "framed.py",
                     "cuda_ipc.py",
                     *sorted(f"client/{path.name}" for path in (ENGINE_DATA / "client").glob("*.py"))]


def make_ref(**overrides: object) -> TensorRef:
    fields: dict[str, object] = {
        "owner": "tcp://127.0.0.1:5555",
        "id": RefId("abcd.1"),
        "dtype": "float32",
        "shape": (2, 3),
        "nbytes": 24,
        "lease_expires_at": 1.7e9,
        "host": "h/boot",
    }
    fields.update(overrides)
    return TensorRef(**fields)  # type: ignore[arg-type]


HEADER = TensorHeader("float32", (2, 3), (3, 1), 24)

EXAMPLES: list[wire.Message] = [
    wire.HelloRequest(PROTOCOL_VERSION, "client-1", "h/boot"),
    wire.HelloReply(PROTOCOL_VERSION, "tcp://127.0.0.1:1", "h/boot", 8 << 20, 65536),
    wire.PullRequest(1, RefId("a.1"), (Transport.SHM, Transport.TCP)),
    wire.PullRequest(1, RefId("a.1"), (Transport.TCP,), bulk=True),
    wire.PullReply(1, RefId("a.1"), Transport.TCP, HEADER, 1.7e9,
                   bulk=wire.BulkGrant("tcp://127.0.0.1:2", b"\x03" * 16, b"\x04" * 32)),
    wire.PullReply(1, RefId("a.1"), Transport.SHM, HEADER, 1.7e9, "omniflow-1-2-3", 4096),
    wire.PullReply(1, RefId("a.2"), Transport.CUDA_IPC, HEADER, 1.7e9,
                   cuda=wire.CudaIpcHandle(0, b"\x01" * 64, 2 << 20, 512, b"/torch_123_456", 8, b"\x02" * 64, True)),
    wire.ChunkRequest(2, RefId("a.1"), 0, 24),
    wire.ChunkReply(2, 0, 24),
    wire.LeaseRequest(3, RefId("a.1"), 30.0),
    wire.LeaseReply(3, 1.7e9),
    wire.ReleaseRequest(4, RefId("a.1")),
    wire.ReleaseReply(4, True),
    wire.StatsRequest(5),
    wire.StatsReply(5, 1, 24, 1, 0, 0),
    wire.PingRequest(6),
    wire.PingReply(6),
    wire.KVFetchRequest(7, ("ab" * 32, "cd" * 32), "p16-l2-h2-d64-bfloat16"),
    wire.KVFetchReply(7, ("ab" * 32,), make_ref(shape=(1, 2, 2, 16, 2, 64), dtype="bfloat16", nbytes=16384)),
    wire.KVFetchReply(8, ()),
    wire.ErrorReply(None, ErrorCode.MALFORMED, "bad"),
]


def test_examples_cover_every_message_type() -> None:
    assert {type(m) for m in EXAMPLES} == set(Message.__args__)


BULK_EXAMPLES: list[wire.BulkMessage] = [
    wire.BulkChunkRequest(1, b"\x03" * 16, RefId("a.1"), 0, 24),
    wire.BulkChunkReply(1, 0, 24, b"\x05" * 16),
    wire.ErrorReply(1, ErrorCode.REFUSED, "refused: no live grant"),
]


@pytest.mark.parametrize("message", BULK_EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_bulk_message_round_trips_and_no_other_is_read_there(message: wire.BulkMessage) -> None:
    assert {type(m) for m in BULK_EXAMPLES} == set(wire.BulkMessage.__args__)
    codec = WireCodec(Limits().max_request_bytes, wire.BulkMessage)
    assert codec.decode(codec.encode(message)) == message
    with pytest.raises(UnknownMessage):
        codec.decode(codec.encode(wire.ChunkRequest(2, RefId("a.1"), 0, 24)))


def test_a_pull_request_of_an_older_client_reads_without_bulk() -> None:
    older = msgspec.msgpack.encode({"type": "PullRequest", "request_id": 1, "ref_id": "a.1", "transports": ["tcp"]})
    assert WireCodec(Limits().max_request_bytes).decode(older) == wire.PullRequest(1, RefId("a.1"), (Transport.TCP,))


_INLINE = wire.PortValue(wire.ValueKind.INLINE, data={"x": [1, 2.5, "three", None, b"raw"]})
WORKER_EXAMPLES: list[wire.WorkerMessage] = [
    wire.HelloRequest(PROTOCOL_VERSION, "executor", "h/boot"),
    wire.HelloReply(PROTOCOL_VERSION, "py-0", "h/boot", 0, 65536),
    wire.PingRequest(1),
    wire.PingReply(1),
    wire.LoadRequest(2),
    wire.LoadReply(2, 3, 1, True, {"rss_bytes": 1.5e8, "llm.generated_tokens": 12.0}),
    wire.ErrorReply(3, ErrorCode.DRAINING, "draining"),
    wire.ExecuteRequest(4, "py", CallHeader("run-1", "square", "workflows.diamond:square", {"k": 1}, ("out",), False,
                                            False, 1, 1, "user:1", "python"),
                        {"x": _INLINE, "t": wire.PortValue(wire.ValueKind.TENSOR, ref=make_ref()),
                         "s": wire.PortValue(wire.ValueKind.STREAM)}, window=64),
    wire.ExecuteStarted(4, "py-0"),
    wire.ExecuteProgress(4, 0.5, "half"),
    wire.ExecuteFrame(4, 0, {"out": _INLINE}),
    wire.ExecuteResult(4, {"out": _INLINE}, ("total",)),
    wire.ExecuteFailed(4, "ValueError: no", retryable=False),
    wire.CancelRequest(4),
    wire.InputFrame(4, "s", _INLINE),
    wire.InputEnd(4, "s"),
    wire.FrameCredit(4, 32),
    wire.InputCredit(4, "s", 32),
]


def test_worker_examples_cover_every_worker_message_type() -> None:
    assert {type(m) for m in WORKER_EXAMPLES} == set(wire.WorkerMessage.__args__)


@pytest.mark.parametrize("message", WORKER_EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_worker_message_round_trips(message: wire.WorkerMessage) -> None:
    codec = WireCodec(1 << 20, wire.WorkerMessage)
    data = codec.encode(message)
    assert codec.decode(data) == message
    assert msgspec.msgpack.decode(data)["type"] == type(message).__name__


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_with_its_tag(message: wire.Message) -> None:
    codec = WireCodec(Limits().max_request_bytes)
    data = codec.encode(message)
    assert codec.decode(data) == message
    assert msgspec.msgpack.decode(data)["type"] == type(message).__name__


def test_wire_module_holds_only_message_types() -> None:
    for name, value in vars(wire).items():
        if name.startswith("_") or inspect.ismodule(value) or value is wire.annotations:
            continue
        if isinstance(value, types.UnionType):  # a message union
            assert all(m.__struct_config__.tag_field == "type" for m in value.__args__), name
        elif inspect.isclass(value) and value.__module__ == wire.__name__:
            assert issubclass(value, msgspec.Struct | enum.Enum), name
            if issubclass(value, msgspec.Struct) and value.__struct_config__.tag is not None:
                assert value.__struct_config__.tag_field == "type", name
        elif not inspect.isclass(value):
            assert name in {"PROTOCOL_VERSION", "RefId"}, name
    assert isinstance(PROTOCOL_VERSION, int)


@pytest.mark.parametrize("message", Message.__args__, ids=lambda m: m.__name__)
def test_transfer_messages_are_named_request_reply_or_event(message: type) -> None:
    assert message.__name__.endswith(("Request", "Reply", "Event"))


def test_tensor_ref_is_a_frozen_handle_that_survives_json() -> None:
    ref = make_ref()
    with pytest.raises(AttributeError):
        ref.id = RefId("other")  # type: ignore[misc]
    assert msgspec.json.decode(msgspec.json.encode(ref), type=TensorRef) == ref
    assert hash(ref) == hash(make_ref())
    located = make_ref(shm=wire.ShmLocation("omniflow-1-2-3", 8192, 4096, 7))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(located), type=TensorRef) == located


def test_not_msgpack_is_malformed() -> None:
    codec = WireCodec(1024)
    with pytest.raises(MalformedMessage) as info:
        codec.decode(b"\xc1\xc1\xc1")
    assert info.value.code is ErrorCode.MALFORMED


def test_unknown_type_is_reported_as_unknown() -> None:
    codec = WireCodec(1024)
    with pytest.raises(UnknownMessage) as info:
        codec.decode(msgspec.msgpack.encode({"type": "LaunchMissilesRequest", "request_id": 1}))
    assert info.value.code is ErrorCode.UNKNOWN_MESSAGE


def test_known_type_with_bad_fields_is_malformed() -> None:
    codec = WireCodec(1024)
    with pytest.raises(MalformedMessage, match="PullRequest"):
        codec.decode(msgspec.msgpack.encode({"type": "PullRequest", "request_id": "one"}))
    with pytest.raises(MalformedMessage, match="type tag"):
        codec.decode(msgspec.msgpack.encode([1, 2, 3]))


def test_oversized_message_is_rejected_before_decoding() -> None:
    codec = WireCodec(64)
    big = codec.encode(ErrorReply(1, ErrorCode.INTERNAL, "x" * 100))
    with pytest.raises(OversizedMessage) as info:
        codec.decode(big)
    assert info.value.code is ErrorCode.OVERSIZED
    assert WireCodec(1024).decode(big) == ErrorReply(1, ErrorCode.INTERNAL, "x" * 100)


def test_pull_request_transport_must_be_known() -> None:
    data = msgspec.msgpack.encode({"type": "PullRequest", "request_id": 1, "ref_id": "a", "transports": ["carrier"]})
    with pytest.raises(MalformedMessage):
        WireCodec(1024).decode(data)
    ok = WireCodec(1024).decode(WireCodec(1024).encode(PullRequest(1, RefId("a"), (Transport.TCP,))))
    assert ok.transports == (Transport.TCP,)


# --- tensors -----------------------------------------------------------------------------------


def roundtrip(value: np.ndarray | torch.Tensor) -> TensorData:
    flat = flatten_tensor(value)
    check_header(flat.header)
    return TensorData(flat.header, bytes(flat.data), Transport.TCP)


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int16", "int32", "int64", "float16", "float32", "float64",
                                   "complex64"])
def test_numpy_arrays_round_trip_bit_exact(dtype: str) -> None:
    rng = np.random.default_rng(7)
    array = (rng.standard_normal((3, 5, 7)) * 100).astype(dtype)
    back = roundtrip(array).numpy()
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()


def test_header_describes_shape_strides_and_size() -> None:
    flat = flatten_tensor(np.zeros((2, 3, 4), np.float64))
    assert flat.header == TensorHeader("float64", (2, 3, 4), (12, 4, 1), 192)
    assert not flat.copied
    assert contiguous_strides(()) == ()


def test_contiguous_array_is_not_copied_and_strided_one_is() -> None:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    assert np.shares_memory(flatten_tensor(base).data, base)
    strided = flatten_tensor(base[:, ::2])
    assert strided.copied and not np.shares_memory(strided.data, base)
    assert roundtrip(base[:, ::2]).numpy().tolist() == base[:, ::2].tolist()


def test_big_endian_input_travels_native() -> None:
    array = np.arange(6, dtype=">i4")
    flat = flatten_tensor(array)
    assert flat.copied and flat.header.dtype == "int32"
    assert roundtrip(array).numpy().tolist() == list(range(6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_torch_tensors_round_trip_bit_exact(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    tensor = (torch.randn(4, 6, generator=gen) * 10).to(dtype)
    back = roundtrip(tensor).torch()
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(torch.uint8) if dtype != torch.bool else back,
                       tensor.view(torch.uint8) if dtype != torch.bool else tensor)


def test_non_contiguous_torch_tensor_is_copied_once() -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    flat = flatten_tensor(tensor)
    assert flat.copied and flat.header.shape == (4, 3)
    assert torch.equal(roundtrip(tensor).torch(), tensor)


def test_torch_view_of_numpy_array_shares_memory() -> None:
    array = np.arange(10, dtype=np.float32)
    data = TensorData(flatten_tensor(array).header, array, Transport.LOCAL)
    assert data.torch().data_ptr() == array.ctypes.data
    assert data.torch(copy=True).data_ptr() != array.ctypes.data


def test_bfloat16_has_no_numpy_view() -> None:
    with pytest.raises(UnsupportedTensor):
        roundtrip(torch.zeros(2, dtype=torch.bfloat16)).numpy()


def test_empty_and_scalar_tensors() -> None:
    assert roundtrip(np.zeros((0, 4), np.float32)).numpy().shape == (0, 4)
    assert roundtrip(torch.zeros((0,))).torch().shape == (0,)
    assert roundtrip(np.array(2.5)).numpy().item() == 2.5


def test_unsupported_values_raise_typed_errors() -> None:
    with pytest.raises(UnsupportedTensor):
        flatten_tensor([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(UnsupportedTensor):
        flatten_tensor(np.array(["a", "b"]))


@pytest.mark.parametrize(
    "header",
    [
        TensorHeader("float128", (2,), (1,), 32),
        TensorHeader("float32", (2, 3), (1, 2), 24),
        TensorHeader("float32", (2, 3), (3, 1), 25),
        TensorHeader("float32", (-1,), (1,), 4),
    ],
)
def test_bad_headers_are_malformed(header: TensorHeader) -> None:
    with pytest.raises(MalformedMessage):
        check_header(header)


def test_header_over_the_limit_is_oversized() -> None:
    with pytest.raises(OversizedMessage):
        check_header(HEADER, max_nbytes=16)


# --- no pickle on the wire path ------------------------------------------------------------------

FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "copyreg", "shelve", "marshal",
                     "multiprocessing"}
FORBIDDEN_CALLS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}


@pytest.mark.parametrize("module", WIRE_PATH_MODULES)
def test_no_wire_path_module_imports_pickle(module: str) -> None:
    tree = ast.parse((ENGINE_DATA / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names = {(node.module or "").split(".")[0]}
        elif isinstance(node, ast.Attribute):
            assert node.attr not in FORBIDDEN_CALLS, f"{module}:{node.lineno} calls {node.attr}"
            continue
        else:
            continue
        assert not names & FORBIDDEN_MODULES, f"{module}:{node.lineno} imports {names & FORBIDDEN_MODULES}"
