"""The `error.type` values of the plugin's HTTP 4xx and 503 answers that a client
branches on (the cluster router's engines, cluster/engine.py): a type, not
the English text of a message, which vLLM or the plugin may reword."""

ADAPTER_INVALID = "LoraServeAdapterInvalid"  # 400: this adapter cannot be served; message says why
ADAPTER_LOADED = "LoraServeAdapterLoaded"  # 400: a load of a name already loaded (not in place)
ADAPTER_UNCHECKED = "LoraServeAdapterUnchecked"  # 503: its tensors could not be read now; retry
ENGINE_UNAVAILABLE = "LoraServeEngineUnavailable"  # 503: the engine is not running; not the adapter
HOST_TIER_FULL = "LoraServeHostTierFull"  # 409: no room to prefetch beside adapters in use; retry
