"""Running a recurrent mixer over a layer's tokens: the sequences of a training batch, each from a
zero state, or an inference step's tokens, each request's from the state its earlier tokens left
(kept by the engine's context)."""


def mix_tokens(mix, projected, layer_number: int, inference_context=None):
    """projected [s, b, c] -> [s, b, c'] by `mix(x [b, s, c], state) -> (y [b, s, c'], state)`:
    over the batch from zero states, or with `inference_context` ([t, 1, c], requests back to
    back) through its `run_recurrent`."""
    if inference_context is not None:
        return inference_context.run_recurrent(layer_number, projected, mix)
    y, _ = mix(projected.transpose(0, 1), None)
    return y.transpose(0, 1)
