"""`nlq-scale quickstart`: the whole path on the bundled sample corpus."""
