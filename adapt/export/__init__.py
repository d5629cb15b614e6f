"""What is written for users to load: dense sentence-transformers folders, sparse (SPLADE) folders, what a folder says, dimension order, ONNX/OpenVINO graphs."""
