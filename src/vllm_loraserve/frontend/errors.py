"""The `error.type` values of the plugin's HTTP 4xx answers that a client
branches on (the cluster router's engines, cluster/engine.py): a type, not
the English text of a message, which vLLM or the plugin may reword."""

ADAPTER_INVALID = "LoraServeAdapterInvalid"  # 400: this adapter cannot be served; message says why
ADAPTER_LOADED = "LoraServeAdapterLoaded"  # 400: a load of a name already loaded (not in place)
