"""The book's printed numbers, reproduced (the fuller suite lives beside this file)."""

import torch

import headwise as hw
from headwise.demo import BOOK_MHA, BOOK_WRAPPER
from headwise.explain import book_batch


def test_book_wrapper_and_mha_print_the_books_numbers():
    torch.manual_seed(123)
    wrapper = hw.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    torch.manual_seed(123)
    mha = hw.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    batch = book_batch()
    for got, book in [(wrapper(batch), BOOK_WRAPPER), (mha(batch), BOOK_MHA)]:
        assert got.shape == (2, 6, len(book[0]))
        torch.testing.assert_close(got[0].detach(), torch.tensor(book), atol=5e-5, rtol=0)
        torch.testing.assert_close(got[1].detach(), torch.tensor(book), atol=5e-5, rtol=0)
