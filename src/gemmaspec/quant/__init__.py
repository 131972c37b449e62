"""Quantization: telling QAT weights apart (``qat``), exact Q4_0 packing (``q4_0_exact``), the
``quantize --exact`` driver (``quantize``), its checkpoint reader (``source``), report (``report``) and
file check behind ``gemmaspec verify`` (``check``)."""
