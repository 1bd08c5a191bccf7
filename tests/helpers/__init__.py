"""Code the tests share: peer processes, server pairs, tiny models, reference readers."""
