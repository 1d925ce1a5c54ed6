"""The coordinator process (coordproc.py): the ROUTER socket's loop (coordinator.py) around the scheduler, a
state machine with no sockets, and its parts (leases, credits, re-planning, peers, figures). It hears the
trainer process only through consumer/protocol.py and the slots (consumer/slots.py), never importing feed/."""
