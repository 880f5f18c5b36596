"""Encoders: a dictionary's directions (an SAE, transcoder, saev or dictionary_learning checkpoint, or the
store's own neurons) loaded from its files and applied to stored activations on the host or a torch device."""
