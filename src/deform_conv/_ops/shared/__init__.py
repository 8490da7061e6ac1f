"""What the ops' Python faces share, in the same files as each op's own: ``function`` (the autocast rule, whether
an ONNX export runs), ``checks`` (tensor and int-pair checks, the supported dtypes) and ``reference`` (the bilinear
sampling both pure-PyTorch references are written with)."""
