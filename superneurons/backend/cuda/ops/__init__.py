"""GPU twins of backend/cpu's ops: one module per CPU module, same function names and signatures."""
