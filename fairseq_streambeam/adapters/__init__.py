"""fairseq adapters: code that reads fairseq-internal layouts (attention, alignment) for the generators."""
