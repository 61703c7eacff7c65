"""Images in prompts: the media a prompt carries, its decoding, the model's processor
step that expands each image into placeholder tokens, the vision encoder's outputs
cached by image hash, and their scatter into the input embeddings at prefill."""
