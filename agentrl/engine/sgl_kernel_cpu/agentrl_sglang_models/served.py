"""The served model's SGLang module, re-exported for SGLang's registry (its ``EntryClass``)."""

import importlib
import os

_MODULE = os.environ.get("AGENTRL_SGLANG_MODEL_MODULE", "")
if _MODULE.startswith("sglang.srt.models."):
    EntryClass = importlib.import_module(_MODULE).EntryClass
