"""The wire between front-ends and engines, release by release: what a client writes in
its engines' release (:mod:`.requests`) and what an engine's outputs become in its
front-end's (:mod:`.outputs`). Both convert corewire's own structs (vLLM 0.25.1's layout,
``corewire.protocol``) by field name into the layouts :mod:`.layouts` builds from each
release's record (``corewire.releases``)."""
