"""Who this node is: its keys and identity files under data_dir (`identity_store`, `datadir`), the node secret's
derivation and the registration with a bootstrap token (`registrar`).
"""
