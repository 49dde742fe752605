"""The bundled trainer: one loop with objectives (next-token LM, DPO), the GPT model and the prefetcher.
Reads batches only through datapipe.loader; never imports curation or Ray."""
