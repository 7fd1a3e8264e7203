"""The trajectory wire format (agentrl.queue.codec): exact round trips, the layout, lazy turns, bad payloads."""

import pickle

import msgpack
import pytest

from agentrl.queue.codec import LazyTurns, from_msgpack, to_msgpack, wire_pieces
from agentrl.types import ARRAYS, SCHEMA_VERSION, FinishReason, SchemaError, ToolCall, ToolResult, Trajectory, Turn


def make_traj(**over):
    fields = dict(
        trajectory_id="t1", prompt_id="p1", group_id="g1",
        token_ids=[5, 6, 7, 100, 101, 200, 201, 102], prompt_len=3,
        loss_mask=[0, 0, 0, 1, 1, 0, 0, 1],
        behavior_logprobs=[0.0, 0.0, 0.0, -0.5, -1.25, 0.0, 0.0, -3.0],
        weight_versions=[-1, -1, -1, 0, 1, -1, -1, 1],
        reward=1.0, finish_reason=FinishReason.STOP, reward_breakdown={"correct": 1.0},
        turns=(Turn(index=0, text="<code>print(1)</code>", token_start=3, token_end=5, observation_len=2,
                    tool_calls=(ToolCall("python", {"code": "print(1)"}, raw="<code>print(1)</code>"),),
                    tool_results=(ToolResult("python", "Finished", "1", 0.01),), generate_s=0.2, tool_s=0.01),
               Turn(index=1, text="\\boxed{1}", token_start=7, token_end=8)),
        env="retool", metadata={"answer": "1", "nested": {"k": [1, 2]}},
    )
    fields.update(over)
    return Trajectory(**fields)


def test_msgpack_round_trip_is_exact():
    t = make_traj()
    back = from_msgpack(to_msgpack(t))
    assert back == t
    assert back.token_ids.tolist() == [5, 6, 7, 100, 101, 200, 201, 102]
    assert back.generated_versions == [0, 1, 1]
    assert back.min_version == 0 and back.num_model_tokens == 3


def test_wire_is_plain_msgpack_with_arrays_as_bytes_and_a_nested_header():
    t = make_traj()
    wire = msgpack.unpackb(to_msgpack(t))
    assert list(wire) == ["schema", *ARRAYS, "turns", "header"]
    assert [wire[name] for name in ARRAYS] == [getattr(t, name).tobytes() for name in ARRAYS]
    assert wire["header"]["trajectory_id"] == "t1" and wire["header"]["metadata"]["nested"] == {"k": [1, 2]}
    turns = msgpack.unpackb(wire["turns"])  # msgpack bytes of the turns, as positional lists
    assert [u[1] for u in turns] == ["<code>print(1)</code>", "\\boxed{1}"] and turns[0][6][0][2] == "1"
    assert b"".join(wire_pieces(t)) == to_msgpack(t)
    assert any(isinstance(p, memoryview) for p in wire_pieces(t))  # the arrays' own memory, not copies


def test_turns_are_decoded_on_first_use_and_behave_as_the_tuple():
    t = make_traj()
    back = from_msgpack(to_msgpack(t))
    assert isinstance(back.turns, LazyTurns) and back.turns.wire is not None  # nothing decoded yet
    assert to_msgpack(back) == to_msgpack(t)  # re-encoding reuses the undecoded bytes
    copy = pickle.loads(pickle.dumps(back))  # e.g. broadcast to the other trainer ranks: still undecoded
    assert isinstance(copy.turns, LazyTurns) and copy.turns.wire is not None and copy == t
    assert back.turns == t.turns and t.turns == back.turns and back.turns[1].text == "\\boxed{1}"
    assert back.turns.wire is None and len(back.turns) == 2 and list(back.turns) == list(t.turns)
    assert back.turns[0].tool_results[0] == ToolResult("python", "Finished", "1", 0.01)
    assert pickle.loads(pickle.dumps(back)) == t and type(pickle.loads(pickle.dumps(back)).turns) is tuple
    assert back.to_dict() == t.to_dict() and to_msgpack(back) == to_msgpack(t)


def test_a_corrupt_turns_blob_raises_schema_error_when_read():
    wire = msgpack.unpackb(to_msgpack(make_traj()))
    wire["turns"] = b"\xc1 not msgpack"
    back = from_msgpack(msgpack.packb(wire, use_bin_type=True))
    assert back.num_tokens == 8  # what a trainer needs is intact
    with pytest.raises(SchemaError, match="turns"):
        len(back.turns)
    wire["turns"] = msgpack.packb([[1, "x"]])
    with pytest.raises(SchemaError, match="turns"):
        list(from_msgpack(msgpack.packb(wire, use_bin_type=True)).turns)


@pytest.mark.parametrize("layout", ["reordered", "bin8 lengths"])
def test_payloads_in_other_layouts_take_the_general_path_to_the_same_trajectory(layout):
    t = make_traj()
    wire = msgpack.unpackb(to_msgpack(t))
    if layout == "reordered":
        wire = {"header": wire.pop("header"), **wire}
    payload = msgpack.packb(wire, use_bin_type=True)  # msgpack's own packer: the shortest bin lengths
    assert from_msgpack(payload) == t


@pytest.mark.parametrize("shape", ["no header map", "turns as lists"])
def test_maps_of_another_shape_are_rejected(shape):
    wire = msgpack.unpackb(to_msgpack(make_traj()))
    if shape == "no header map":
        wire = {**wire.pop("header"), **wire}
    else:
        wire["turns"] = msgpack.unpackb(wire["turns"])
    with pytest.raises(SchemaError, match="header" if shape == "no header map" else "turns"):
        from_msgpack(msgpack.packb(wire, use_bin_type=True))


def test_empty_trajectory_round_trips():
    t = make_traj(token_ids=[], prompt_len=0, loss_mask=[], behavior_logprobs=[], weight_versions=[], turns=())
    assert from_msgpack(to_msgpack(t)) == t


@pytest.mark.parametrize("cut", [3, 20, 60, -5])
def test_truncated_or_corrupted_payloads_raise_schema_error(cut):
    payload = to_msgpack(make_traj())
    with pytest.raises(SchemaError):
        from_msgpack(payload[:cut])
    corrupted = bytearray(payload)
    corrupted[cut] ^= 0xFF
    try:
        back = from_msgpack(bytes(corrupted))
    except SchemaError:
        return
    assert back.num_tokens == 8  # a flipped byte inside an array's data decodes (to other numbers), no crash


def test_float32_logprobs_from_engine_survive_exactly():
    import numpy as np

    lp = [float(np.float32(x)) for x in (-0.123456789, -7.3e-5, -12.5)]
    t = make_traj(token_ids=[1, 2, 3], prompt_len=0, loss_mask=[1, 1, 1], behavior_logprobs=lp,
                  weight_versions=[2, 2, 2], turns=())
    assert from_msgpack(to_msgpack(t)).behavior_logprobs.tolist() == lp


def test_wire_carries_schema_version_and_rejects_others():
    t = make_traj()
    wire = msgpack.unpackb(to_msgpack(t))
    assert wire["schema"] == SCHEMA_VERSION
    wire["schema"] = SCHEMA_VERSION + 1
    with pytest.raises(SchemaError, match="schema"):
        from_msgpack(msgpack.packb(wire))


@pytest.mark.parametrize("payload", [b"", b"\xff\xfe garbage", msgpack.packb([1, 2]), msgpack.packb({"schema": 1})])
def test_garbage_payloads_raise_schema_error(payload):
    with pytest.raises(SchemaError):
        from_msgpack(payload)


def test_strided_read_only_arrays_are_made_contiguous():
    import numpy as np

    strided = np.arange(16, dtype="<i4")[::2]
    strided.setflags(write=False)
    t = make_traj(token_ids=strided, prompt_len=0, loss_mask=[1] * 8, behavior_logprobs=[0.0] * 8,
                  weight_versions=[0] * 8, turns=())
    assert t.token_ids.flags.c_contiguous and t.token_ids.tolist() == list(range(0, 16, 2))
    assert from_msgpack(to_msgpack(t)) == t


def test_decoding_is_zero_copy_and_json_dict_has_plain_lists():
    import json

    t = from_msgpack(to_msgpack(make_traj()))
    assert not t.token_ids.flags.owndata  # a view on the payload bytes
    json.dumps(t.to_dict())  # plain Python types only
