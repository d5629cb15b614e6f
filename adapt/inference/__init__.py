"""Loading encoders and embedding text: load_encoder, adapt embed (plain or sharded), sparse embedding, ONNX/OpenVINO graphs behind a model's interface, the mteb adapter."""
