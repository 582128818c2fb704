"""A whole AFD group on one machine: child processes, groups in processes or threads, offline batches, and `afd up`
(`up`: a supervised local deployment behind one URL; `up_messages`: what it tells the user).

What `afd generate`, `afd run-batch`, `afd up` and the tests start locally; pods never use it.
"""
