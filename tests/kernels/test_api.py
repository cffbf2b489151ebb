def test_twins_work_inside_and_outside_inference_mode_in_either_order():
    import torch

    from epdserve.kernels import paged_attention

    q, kc, vc = torch.randn(2, 4, 32), torch.randn(8, 16, 2, 32), torch.randn(8, 16, 2, 32)
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    lens, starts = (
        torch.tensor([20, 30], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
    )
    with torch.inference_mode():
        inside = paged_attention(q, kc, vc, table, lens, starts, 0.1)
    outside = paged_attention(q, kc, vc, table, lens, starts, 0.1)
    assert torch.equal(inside, outside)
