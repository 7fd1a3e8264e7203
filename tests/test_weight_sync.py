"""The weight-sync offer (agentrl.weight_sync): bucket planning, the JSON document both sides read, bad input, and
the ``weight_sync`` section of a run's configuration."""

from __future__ import annotations

import pytest

from agentrl.errors import ConfigError
from agentrl.launcher.config import load_config
from agentrl.weight_sync import BucketMeta, TensorOffer, WeightOffer, plan_buckets


def test_buckets_keep_the_order_hold_one_dtype_and_stay_under_the_size() -> None:
    named = [("a", "float32", (4, 4)), ("b", "float32", (8,)), ("c", "bfloat16", (2, 3)), ("d", "bfloat16", (100,)),
             ("e", "float32", (1,))]
    buckets = plan_buckets(named, bucket_bytes=96)
    assert [n for b in buckets for n in b.names] == ["a", "b", "c", "d", "e"]
    for b in buckets:
        assert b.nbytes <= 96 or len(b.names) == 1  # only a tensor larger than a bucket gets one to itself
    # a (64 bytes) and b (32) fill one bucket exactly; c starts a new dtype; d (200) is larger than a bucket
    assert [(b.names, b.dtype) for b in buckets] == [(("a", "b"), "float32"), (("c",), "bfloat16"),
                                                     (("d",), "bfloat16"), (("e",), "float32")]
    together = plan_buckets(named, bucket_bytes=1 << 20)
    assert [(b.names, b.dtype) for b in together] == [(("a", "b"), "float32"), (("c", "d"), "bfloat16"),
                                                      (("e",), "float32")]
    assert together[0].nbytes == (16 + 8) * 4 and together[1].nbytes == (6 + 100) * 2
    assert plan_buckets([], 10) == []
    with pytest.raises(ConfigError, match="positive"):
        plan_buckets(named, 0)


def test_an_offer_goes_through_json_unchanged_and_a_malformed_one_is_refused_with_its_fields() -> None:
    offer = WeightOffer(version=3, address="10.0.0.2", port=29500, group="g", world_size=3, backend="gloo",
                        timeout_s=60.0, buckets=(BucketMeta(("x", "y"), "bfloat16", ((2, 2), (3,))),))
    assert WeightOffer.from_dict(offer.to_dict()) == offer
    assert offer.nbytes == (4 + 3) * 2
    broken = offer.to_dict()
    del broken["port"]
    with pytest.raises(ConfigError, match="malformed weight offer"):
        WeightOffer.from_dict(broken)
    odd = offer.to_dict()
    odd["buckets"][0]["dtype"] = "complex64"
    with pytest.raises(ConfigError, match="complex64.*expected one of"):
        WeightOffer.from_dict(odd)
    uneven = offer.to_dict()
    uneven["buckets"][0]["shapes"] = [[2, 2]]
    with pytest.raises(ConfigError, match="one shape per name"):
        WeightOffer.from_dict(uneven)


def test_the_run_config_takes_the_mode_shorthand_and_the_full_section(tmp_path) -> None:
    short = tmp_path / "short.yaml"
    short.write_text("weight_sync: distributed\n")
    assert load_config(short).weight_sync.mode == "distributed"
    full = load_config(None, ["weight_sync.mode=distributed", "weight_sync.bucket_mb=64", "weight_sync.timeout_s=30",
                              "weight_sync.fallback=none", "weight_sync.address=10.1.2.3"])
    ws = full.weight_sync
    assert (ws.mode, ws.bucket_mb, ws.timeout_s, ws.fallback, ws.address) == ("distributed", 64, 30, "none",
                                                                              "10.1.2.3")
    assert load_config(None).weight_sync.mode == "disk"
    with pytest.raises(ConfigError, match="weight_sync.mode"):
        load_config(None, ["weight_sync.mode=nfs"])
    with pytest.raises(ConfigError, match="did you mean 'weight_sync.bucket_mb'"):
        load_config(None, ["weight_sync.bucket_size=64"])


def test_a_tensor_offer_goes_through_json_unchanged_and_a_malformed_one_is_refused() -> None:
    offer = TensorOffer(version=4, host="node/boot", payloads=("gASV", "gASW"))
    assert TensorOffer.from_dict(offer.to_dict()) == offer
    with pytest.raises(ConfigError, match="malformed tensor offer.*'host', 'version'"):
        TensorOffer.from_dict({"version": 4, "host": "node/boot"})


def test_weight_sync_tensor_is_refused_for_servers_or_placements_off_the_trainers_host() -> None:
    assert load_config(None, ["weight_sync=tensor"]).weight_sync.mode == "tensor"
    assert load_config(None, ["weight_sync=tensor", "engine.url=http://127.0.0.1:30000,http://localhost:30001"])
    with pytest.raises(ConfigError, match="must run on its host; engine.url names http://10.0.0.7:30000"):
        load_config(None, ["weight_sync=tensor", "engine.url=http://127.0.0.1:30000,http://10.0.0.7:30000"])
    assert load_config(None, ["weight_sync=distributed", "engine.url=http://10.0.0.7:30000"])
    with pytest.raises(ConfigError, match="place them on different nodes"):
        load_config(None, ["weight_sync=tensor", "resources.trainer_resources={trainer_node: 1}",
                           "resources.rollout_resources={rollout_node: 1}"])
