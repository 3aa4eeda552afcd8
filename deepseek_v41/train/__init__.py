"""Training side: corpus (``data``, ``sources``, ``text``), tokenizer training (``tokenizer``) and evaluation
(``evaluate``)."""
