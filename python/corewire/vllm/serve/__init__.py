"""A ``vllm serve`` stack over corewire engines, for the serve script, the benchmarks and
the tests: the launcher (:mod:`.stack`, ``python -m corewire.vllm.serve.stack``) and the
tiny local model directories it serves (:mod:`.model_dir`, :mod:`.model_dir_llava`:
a tokenizer and seeded random weights, nothing downloaded)."""
