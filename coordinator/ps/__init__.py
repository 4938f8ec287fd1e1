"""Parameter-server training: the wire format, the server, the trainer's client, the model.

Tensors never go through etcd (too big) and never as pickles (unpickling what a
peer sends runs its code): they travel as raw float32 bytes over TCP between a
member's roster endpoint and the trainers, framed by `wire`.
"""
