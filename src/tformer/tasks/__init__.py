"""What the trainer and the CLI need from each family, behind one interface.

A task owns a family's data (tokenizer, splits, batching), its training loss and its
validation metrics:

    task = family.task(cfg, tokenizer)     # tokenizer None: fit one to the training data
    task.tokenizer
    task.model_fields() -> dict            # config fields the data decides (vocab_size)
    task.train_batches(seed) -> iterator   # with state_dict() / load_state_dict() for resume
    task.new_carry() -> carry              # what one step hands the next (None for most)
    task.loss(model, batch, carry) -> (mean loss tensor, number of target tokens, carry)
    task.save_carry(carry) / task.load_carry(saved)   # the carry in a checkpoint
    task.evaluate(model, max_batches=0, shard=WHOLE, index=0) -> {"loss": ..., ...}
                                           # validation; index: which of the run's
                                           # evaluations (1, 2, ...; 0 outside training),
                                           # for a task that measures more every few (BLEU)

The carry is an explicit input and output of `loss`, never state inside the task, so the
trainer can put it back when it skips a step (Transformer-XL's memory is one).
"""
