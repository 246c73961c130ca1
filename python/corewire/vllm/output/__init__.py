"""Native output processing inside vLLM's ``AsyncLLM``: corewire's ``OutputProcessor``
(:mod:`.processor`, vLLM 0.25.1's; :mod:`.v0_33_0` and :mod:`.v0_34_0` for the later
releases), each release's class chosen in :mod:`.by_release`, and vLLM's inter-token
latency histogram fed from it (:mod:`.latency_histogram`). Nothing is imported here:
each module imports the vLLM it needs when it is chosen."""
