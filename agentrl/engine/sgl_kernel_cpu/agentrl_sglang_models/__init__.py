"""SGLang's ``SGLANG_EXTERNAL_MODEL_PACKAGE`` for agentrl's CPU servers: only the module that defines the served
model's architecture (``$AGENTRL_SGLANG_MODEL_MODULE``, chosen by :class:`agentrl.engine.SGLangServer`) is imported,
instead of every model module SGLang has (~4 s of a server start on our CPUs, and dozens of "Ignore import error"
lines). An architecture not found here makes SGLang import all of them, as without this package."""
