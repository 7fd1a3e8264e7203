"""Scratch (not committed): decode tokens/s of agentrl's server with and without POST /freeze_gc at start."""
import runpy
import sys

sys.path.insert(0, "benchmarks")
from agentrl.engine import server as S  # noqa: E402

orig = S.SGLangServer._freeze_gc


def patched(self):
    return False if "AGENTRL_NOFREEZE_TAG" in self.config.env else orig(self)


S.SGLangServer._freeze_gc = patched
sys.argv = ["sglang_decode_bench.py", "--vs-env", "AGENTRL_NOFREEZE_TAG=1", *sys.argv[1:]]
runpy.run_path("benchmarks/sglang_decode_bench.py", run_name="__main__")
