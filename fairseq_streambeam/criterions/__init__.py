"""fairseq criterions registered by the plugin."""
