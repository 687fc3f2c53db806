"""Offline dataset preparation: download, validation, manifest building and the spoken
corpora. Nothing a training or evaluation run imports reaches this package; it may import
`rnnt.data` (the manifest format, the tokenizer, transcript normalization)."""
