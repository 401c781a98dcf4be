"""What the trainer and the CLI need from each family, behind one interface.

A task owns a family's data (tokenizer, splits, batching), its training loss and its
validation metrics:

    task = family.task(cfg, tokenizer)     # tokenizer None: fit one to the training data
    task.tokenizer
    task.model_fields() -> dict            # config fields the data decides (vocab_size)
    task.train_batches(seed) -> iterator   # with state_dict() / load_state_dict() for resume
    task.loss(model, batch) -> (mean loss tensor, number of target tokens)
    task.evaluate(model, max_batches=0) -> {"loss": ..., ...}   # on the validation split
"""
