"""fairseq models registered by the plugin."""
