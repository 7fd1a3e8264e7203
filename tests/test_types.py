"""The shared data types: a trajectory's invariants, read-only typed arrays, and its plain (JSON) form.
The wire format is tested in tests/queue/test_codec.py."""

import json

import numpy as np
import pytest

from agentrl.types import (
    ARRAYS,
    SCHEMA_VERSION,
    FinishReason,
    SchemaError,
    ToolCall,
    ToolResult,
    Trajectory,
    Turn,
    turns_from_lists,
    turns_to_lists,
)


def make_traj(**over):
    fields = dict(
        trajectory_id="t1", prompt_id="p1", group_id="g1", token_ids=[5, 6, 7, 8], prompt_len=2,
        loss_mask=[0, 0, 1, 1], behavior_logprobs=[0.0, 0.0, -0.5, -1.0], weight_versions=[-1, -1, 3, 3],
        reward=0.5, finish_reason=FinishReason.STOP,
        turns=(Turn(index=0, text="<code>1</code>", token_start=2, token_end=4,
                    tool_calls=(ToolCall("python", {"code": "1"}),),
                    tool_results=(ToolResult("python", "Finished", "1"),)),),
    )
    fields.update(over)
    return Trajectory(**fields)


def test_misaligned_arrays_are_rejected():
    with pytest.raises(SchemaError, match="loss_mask"):
        make_traj(loss_mask=[0, 1])
    with pytest.raises(SchemaError, match="prompt tokens"):
        make_traj(loss_mask=[1, 0, 1, 1])


def test_arrays_are_read_only_and_typed_and_the_callers_array_is_untouched():
    ids = np.array([1, 2, 3], dtype="<i4")
    t = make_traj(token_ids=ids, prompt_len=1, loss_mask=[0, 1, 1], behavior_logprobs=[0.0, -1.0, -2.0],
                  weight_versions=[-1, 4, 5], turns=(), created_at=1.0)
    assert ids.flags.writeable and t.token_ids is not ids
    with pytest.raises(ValueError):
        t.token_ids[0] = 9
    assert (t.token_ids.dtype, t.loss_mask.dtype, t.behavior_logprobs.dtype, t.weight_versions.dtype) == (
        np.dtype("<i4"), np.dtype("u1"), np.dtype("<f4"), np.dtype("<i4"))
    assert t.min_version == 4 and t.generated_versions == [4, 5] and t.num_model_tokens == 2
    assert t == make_traj(token_ids=[1, 2, 3], prompt_len=1, loss_mask=[0, 1, 1], behavior_logprobs=[0.0, -1.0, -2.0],
                          weight_versions=[-1, 4, 5], turns=(), created_at=1.0)
    assert t != make_traj(token_ids=[1, 2, 4], prompt_len=1, loss_mask=[0, 1, 1], behavior_logprobs=[0.0, -1.0, -2.0],
                          weight_versions=[-1, 4, 5], turns=(), created_at=1.0)


def test_turn_as_dict_names_every_field_down_to_the_calls():
    turn = Turn(index=0, text="x", token_start=1, token_end=2,
                tool_calls=(ToolCall(name="python", arguments={"code": "1"}),),
                tool_results=(ToolResult(name="python", status="Finished", output="1\n"),))
    d = turn.as_dict()
    assert d["tool_calls"] == [{"name": "python", "arguments": {"code": "1"}, "raw": "", "error": None}]
    assert d["tool_results"][0]["status"] == "Finished" and d["text"] == "x"
    assert json.loads(json.dumps(d)) == d


def test_plain_form_is_json_with_positional_turns_that_read_back():
    t = make_traj()
    d = json.loads(json.dumps(t.to_dict()))
    assert d["schema"] == SCHEMA_VERSION and d["trajectory_id"] == "t1" and d["finish_reason"] == "stop"
    assert [d[name] for name in ARRAYS] == [getattr(t, name).tolist() for name in ARRAYS]
    assert d["turns"] == turns_to_lists(t.turns) and d["turns"][0][6][0][2] == "1"  # positional: turn, result, output
    assert turns_from_lists(d["turns"]) == t.turns
    with pytest.raises(SchemaError, match="turns"):
        turns_from_lists([[1, "x"]])
