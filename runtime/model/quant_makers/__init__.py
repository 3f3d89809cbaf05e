"""Writers of quantized test and benchmark checkpoints, one per tool (make_quant_model.py)."""
