"""corewire's engine-core client as vLLM's ``AsyncLLM`` builds it: the client factory and
the classes it chooses among (:mod:`.classes`), what they share (:mod:`.client`,
:mod:`.dp_client`), what later releases add (:mod:`.v0_33_0`, :mod:`.v0_34_0`), each
release's launch and ready helpers (:mod:`.frontend`), and requests with images through
vLLM's own encoder (:mod:`.multimodal`)."""
