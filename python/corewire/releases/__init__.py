"""vLLM's wire layouts per release: derived from vLLM's own classes, or recorded.

``corewire.releases.derive`` reads the wire structs off an importable vLLM;
``data/vllm-<release>.json`` holds what it read for each release corewire has recorded
(``tools/record-vllm-release`` writes them); ``corewire.releases.structs`` turns such a
record into msgspec structs.
"""
