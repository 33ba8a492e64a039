"""Plain-numpy re-derivation of the loss math of `jaxrl4llm.core`, written from the papers.

This module is the independent oracle of the core test-suite: it never imports jax nor the
implementation. Every function is written for clarity (explicit loops over rows and groups),
computes in float64 and cites the paper (or the reference code base) its formula comes from.

Conventions (DESIGN.md): a batch holds P prompts x G responses = B rows, the G responses of
a prompt adjacent (row b is in group b // G); token arrays are [B, T] with a float mask.

Papers:
  [PPO]      Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347.
  [GRPO]     Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300 (group-relative advantages,
             k3 KL estimator in the loss).
  [DAPO]     Yu et al. 2025, "DAPO", arXiv 2503.14476 (Clip-Higher, dynamic sampling,
             token-level loss, overlong filtering and soft overlong punishment).
  [DrGRPO]   Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783
             (no std normalisation, constant length normaliser).
  [GSPO]     Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071.
  [LitePPO]  Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
             arXiv 2508.08221 (group-level mean, batch-level std).
  [RLOO]     Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
             Optimization", arXiv 2402.14740 (leave-one-out baseline).
  [REINFORCE++] Hu 2025, arXiv 2501.03262 (global batch advantage whitening).
  [DualClip] Ye et al. 2020, "Mastering Complex Control in MOBA Games", arXiv 1912.09729.
  [Schulman-KL] J. Schulman, "Approximating KL divergence" (2020 blog): k1, k2, k3.
  [TIS]      Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
             training" (truncated importance sampling of trainer vs sampler probabilities).
  [CISPO]    MiniMax 2025, "MiniMax-M1", arXiv 2506.13585, eq. (4)-(5) (clipped, detached IS
             weight times log pi).
  [SAPO]     Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347 (soft gate
             f(r) = 4/tau sigmoid(tau (r - 1)), tau by advantage sign).
  [ScaleRL]  Khatri et al. 2025, "The Art of Scaling RL Compute for LLMs", arXiv 2510.13786
             (prompt-level loss aggregation).
  [MIS]      masked IS, the masking variant of [TIS] (verl rollout_is "mask" mode: kept tokens
             keep the IS weight).
  [IcePop]   Ring-1T, inclusionAI, arXiv 2510.18855 (tokens with pi_train / pi_infer outside
             [alpha, beta] leave the update).
  [DSV32]    DeepSeek-V3.2 (off-policy sequence masking: negative-advantage rows whose mean
             log(pi_sampler / pi_old) exceeds delta leave the loss).
  [EntropyMech] Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
             Language Models", arXiv 2505.22617 (Clip-Cov, KL-Cov).
  [OPD]      Thinking Machines 2025, "On-Policy Distillation" (tinker-cookbook
             distillation/train_on_policy.py: advantages += -coef·mask·(log pi - log pi_T),
             optionally its discounted future sum); GKD, Agarwal et al. 2024, arXiv 2306.13649.
  [verl]     volcengine/verl core_algos.py (log-ratio clamp to +-20, dual clip "clip_ratio_c",
             low_var_kl clamp to +-10, agg_loss modes).
"""

from __future__ import annotations

import math

import numpy as np

LOG_RATIO_CLAMP = 20.0  # [verl] compute_policy_loss / kl_penalty clamp the log-ratio to +-20.


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _std(values, ddof):
    """Std with `ddof`; a set with n <= ddof elements has std 0 (spec)."""
    values = _f64(values)
    n = values.size
    if n <= ddof:
        return 0.0
    mean = values.sum() / n
    return math.sqrt(((values - mean) ** 2).sum() / (n - ddof))


# --------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------


def normalize_advantages(rewards, group_size, *, mean="group", std="group", eps=1e-6, ddof=1, valid=None):
    """A_i = (r_i - m_i) / (s_i + eps).

    [GRPO] eq. (outcome supervision): A_i = (r_i - mean(r_group)) / std(r_group).
    [DrGRPO]: A_i = r_i - mean(r_group) (no std).  [LitePPO]: group mean, batch std.
    m: group mean / batch mean / 0.  s: std (ddof) of the RAW rewards in the group / over the
    batch; std="none" means s = 1 and eps is NOT added (A = r - m exactly). A set with
    n <= ddof elements has std 0. Rows of an all-equal group have group-centred value 0.
    """
    r = _f64(rewards)
    B = r.shape[0]
    if B % group_size:
        raise ValueError("batch size must be a multiple of group_size")
    out = np.zeros(B)
    # batch-level statistics over the `valid` rows (dynamic sampling: the groups that train)
    kept = r if valid is None else r[np.asarray(valid) > 0]
    batch_mean = kept.sum() / len(kept) if len(kept) else 0.0
    batch_std = _std(kept, ddof)
    for g in range(B // group_size):
        rows = slice(g * group_size, (g + 1) * group_size)
        group = r[rows]
        group_constant = bool(np.all(group == group[0]))
        for i in range(g * group_size, (g + 1) * group_size):
            if mean == "group":
                centred = 0.0 if group_constant else r[i] - group.sum() / group_size
            elif mean == "batch":
                centred = r[i] - batch_mean
            elif mean == "none":
                centred = r[i]
            else:
                raise ValueError(mean)
            if std == "group":
                out[i] = centred / (_std(group, ddof) + eps)
            elif std == "batch":
                out[i] = centred / (batch_std + eps)
            elif std == "none":
                out[i] = centred
            else:
                raise ValueError(std)
    return out


def rloo_advantages(rewards, group_size):
    """[RLOO]: A_i = r_i - 1/(G-1) sum_{j != i} r_j (leave-one-out); size-1 groups give 0."""
    r = _f64(rewards)
    out = np.zeros(r.shape[0])
    for g in range(r.shape[0] // group_size):
        idx = list(range(g * group_size, (g + 1) * group_size))
        for i in idx:
            others = [r[j] for j in idx if j != i]
            out[i] = 0.0 if not others else r[i] - sum(others) / len(others)
    return out


def batch_whiten(values, mask=None, *, eps=1e-6):
    """[REINFORCE++]: (x - masked mean) / (masked std (ddof 0) + eps); masked entries 0."""
    x = _f64(values)
    m = np.ones_like(x) if mask is None else _f64(mask)
    count = m.sum()
    if count == 0:
        return np.zeros_like(x)
    mean = (x * m).sum() / count
    var = (((x - mean) ** 2) * m).sum() / count
    return np.where(m > 0, (x - mean) / (math.sqrt(var) + eps), 0.0)


# --------------------------------------------------------------------------------------
# Log-probs, entropy
# --------------------------------------------------------------------------------------


def log_softmax(logits, axis=-1):
    z = _f64(logits)
    z = z - z.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def token_logprobs(logits, tokens, temperature=1.0):
    """log softmax(logits / temperature)[token], token by token."""
    lp = log_softmax(_f64(logits) / temperature)
    B, T = tokens.shape
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            out[b, t] = lp[b, t, int(tokens[b, t])]
    return out


def entropy_from_logits(logits, temperature=1.0):
    """H = -sum_v p_v log p_v with p = softmax(logits / temperature)."""
    lp = log_softmax(_f64(logits) / temperature)
    return -(np.exp(lp) * lp).sum(axis=-1)


# --------------------------------------------------------------------------------------
# Surrogate
# --------------------------------------------------------------------------------------


def _token_advantages(advantages, shape):
    a = _f64(advantages)
    if a.ndim == 1:
        a = np.repeat(a[:, None], shape[1], axis=1)
    return a


def ratio(logp, old_logp, mask=None, ratio_level="token"):
    """Importance ratio per token.

    token [PPO]: r_t = exp(logp_t - old_logp_t) (log-ratio clamped to +-20 as in [verl]).
    sequence [GSPO] eq. (7): s_i = exp(1/|y_i| sum_t (logp - old_logp)) on every token of row i
    (GSPO-token, "sequence_token", has the same value).
    """
    lr = np.clip(_f64(logp) - _f64(old_logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if ratio_level == "token":
        return np.exp(lr)
    m = _f64(mask)
    lr = _f64(logp) - _f64(old_logp)
    B, T = lr.shape
    out = np.ones((B, T))
    for b in range(B):
        n = m[b].sum()
        seq_lr = (lr[b] * m[b]).sum() / n if n > 0 else 0.0
        out[b, :] = math.exp(min(max(seq_lr, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP))
    return out


def clipped_surrogate(logp, old_logp, advantages, mask, *, eps_low=0.2, eps_high=0.2,
                      dual_clip=None, ratio_level="token"):
    """Per-token clipped surrogate loss and its statistics.

    [PPO] eq. (7), as a loss: l = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A).
    [DAPO] Clip-Higher: eps_high > eps_low.
    [DualClip] for A < 0: l = min(l, -c A) (= c |A|), i.e. verl's clip_ratio_c.
    [GSPO]: r replaced by the sequence ratio s_i.
    Returns (loss [B, T] zero where mask == 0, stats dict).
    """
    m = _f64(mask)
    r = ratio(logp, old_logp, m, ratio_level)
    A = _token_advantages(advantages, r.shape)
    B, T = r.shape
    loss = np.zeros((B, T))
    n = low = high = dual = 0.0
    ratios = []
    for b in range(B):
        for t in range(T):
            rr, aa = r[b, t], A[b, t]
            unclipped = -rr * aa
            clipped = -min(max(rr, 1 - eps_low), 1 + eps_high) * aa
            l = max(unclipped, clipped)
            if dual_clip is not None and aa < 0:
                l = min(l, -dual_clip * aa)
            if m[b, t] > 0:
                loss[b, t] = l * m[b, t]
                n += m[b, t]
                low += m[b, t] * (aa < 0 and rr < 1 - eps_low)
                high += m[b, t] * (aa > 0 and rr > 1 + eps_high)
                if dual_clip is not None:
                    dual += m[b, t] * (aa < 0 and rr > dual_clip)
                ratios.append(rr)
    safe = max(n, 1e-30)
    lr = _f64(old_logp) - _f64(logp)
    stats = dict(
        clip_frac_low=low / safe if n else 0.0,
        clip_frac_high=high / safe if n else 0.0,
        clip_frac=(low + high) / safe if n else 0.0,
        dual_clip_frac=dual / safe if n else 0.0,
        ratio_mean=float((r * m).sum() / n) if n else 1.0,
        ratio_min=min(ratios) if ratios else 1.0,
        ratio_max=max(ratios) if ratios else 1.0,
        approx_kl=float((lr * m).sum() / n) if n else 0.0,
        num_tokens=float(m.sum()),
    )
    return loss, stats


def surrogate_grad(logp, old_logp, advantages, mask, *, eps_low=0.2, eps_high=0.2,
                   dual_clip=None, ratio_level="token"):
    """d/d logp of sum_{b,t} loss[b, t], derived by hand.

    Token level: dl_t/dlogp_t = -A r_t where the unclipped branch is active, 0 where a clip
    (PPO clip or dual clip) binds. GSPO-token ("sequence_token", [GSPO] eq. 13-14): d s_i,t /
    d logp_t = s_i, so -A_t s_i m_t where token t's clip is inactive. GSPO ("sequence", eq.
    5-8): every token t' of row i depends on all logp_t through s_i, d s_i / d logp_t =
    s_i m_t / L_i, so g_t = -(s_i m_t / L_i) sum_{t' active} A_t' m_t'; with A constant over
    the row it is -A s_i m_t, as GSPO-token. At both sequence levels a row whose mean
    log-ratio reaches the clamp (|.| >= 20) has no gradient.
    """
    m = _f64(mask)
    r = ratio(logp, old_logp, m, ratio_level)
    A = _token_advantages(advantages, r.shape)
    g = np.zeros_like(r)
    act = np.zeros_like(r)
    for b in range(r.shape[0]):
        for t in range(r.shape[1]):
            rr, aa = r[b, t], A[b, t]
            active = True
            if aa > 0 and rr > 1 + eps_high:
                active = False
            if aa < 0 and rr < 1 - eps_low:
                active = False
            if dual_clip is not None and aa < 0 and rr > dual_clip:
                active = False
            act[b, t] = float(active)
            g[b, t] = -aa * rr * m[b, t] if active else 0.0
    if ratio_level == "sequence":
        for b in range(r.shape[0]):
            L = m[b].sum()
            if L == 0:
                continue
            if abs(math.log(r[b, 0])) >= LOG_RATIO_CLAMP:  # the clamp binds: no gradient
                g[b] = 0.0
                continue
            total = sum(A[b, t] * m[b, t] * act[b, t] for t in range(r.shape[1]))
            g[b] = -r[b, 0] * m[b] / L * total
    if ratio_level == "sequence_token":
        for b in range(r.shape[0]):
            if m[b].sum() > 0 and abs(math.log(r[b, 0])) >= LOG_RATIO_CLAMP:
                g[b] = 0.0
    return g


def cispo_surrogate(logp, old_logp, advantages, mask, *, eps_low=1.0, eps_high=4.0,
                    cap_mode="relative"):
    """[CISPO] eq. (4) as a per-token loss: l = -sg(clip(r, 1 - eps_low, hi)) A log pi.

    hi = 1 + eps_high ("relative", verl, the paper's eps^IS_high) or eps_high ("absolute",
    TRL's epsilon_high). Returns (loss [B, T], d loss / d logp [B, T] = -clip(r) A m).
    """
    m = _f64(mask)
    r = ratio(logp, old_logp)
    A = _token_advantages(advantages, r.shape)
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high if cap_mode == "relative" else eps_high
    lp = _f64(logp)
    loss = np.zeros_like(r)
    grad = np.zeros_like(r)
    for b in range(r.shape[0]):
        for t in range(r.shape[1]):
            if m[b, t] > 0:
                w = min(max(r[b, t], lo), hi)
                loss[b, t] = -w * A[b, t] * lp[b, t] * m[b, t]
                grad[b, t] = -w * A[b, t] * m[b, t]
    return loss, grad


def sapo_surrogate(logp, old_logp, advantages, mask, *, tau_pos=1.0, tau_neg=1.05):
    """[SAPO]: l = -f(r) A, f(r) = 4/tau sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else
    tau_neg. Returns (loss, d loss / d logp = -A r f'(r), f'(r) = 4 s (1 - s))."""
    m = _f64(mask)
    r = ratio(logp, old_logp)
    A = _token_advantages(advantages, r.shape)
    loss = np.zeros_like(r)
    grad = np.zeros_like(r)
    for b in range(r.shape[0]):
        for t in range(r.shape[1]):
            if m[b, t] > 0:
                tau = tau_pos if A[b, t] > 0 else tau_neg
                s = 1.0 / (1.0 + math.exp(-tau * (r[b, t] - 1.0)))
                loss[b, t] = -4.0 / tau * s * A[b, t] * m[b, t]
                grad[b, t] = -A[b, t] * r[b, t] * 4.0 * s * (1.0 - s) * m[b, t]
    return loss, grad


# --------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------


def aggregate_loss(loss, mask, mode, *, norm_length=None, row_weights=None, group_size=None,
                   total_rows=None):
    """(numerator, denominator) of the scalar loss; value = num / den (0 if den == 0).

    token-mean [DAPO] eq. (12): sum_{i,t} l / sum_i |y_i|.
    seq-mean-token-mean [GRPO] eq. (3): 1/G sum_i 1/|y_i| sum_t l.
    seq-mean-token-sum: 1/G sum_i sum_t l.
    seq-mean-token-sum-norm [DrGRPO]: 1/G sum_i sum_t l / MAX_TOKENS (a constant).
    seq-sum-token-sum-norm [verl, ROLL agg_loss "seq-mean-token-sum-norm"]: sum_i sum_t l /
    MAX_TOKENS, no mean over rows; the denominator is the call's share of total_rows.
    Rows with row weight 0 are left out of the denominators only.
    prompt-mean-token-mean [ScaleRL]: 1/P sum_p (sum_{i in p, t} l / sum_{i in p} |y_i|) over
    prompts with a counted token; here row_weights are 0/1 and rows with 0 leave their prompt
    (numerator too); needs group_size.
    """
    l, m = _f64(loss), _f64(mask)
    B = l.shape[0]
    w = np.ones(B) if row_weights is None else _f64(row_weights)
    num = den = 0.0
    if mode == "prompt-mean-token-mean":
        for g in range(B // group_size):
            rows = [b for b in range(g * group_size, (g + 1) * group_size) if w[b] > 0]
            tokens = sum(m[b].sum() for b in rows)
            if tokens > 0:
                num += sum((l[b] * m[b]).sum() for b in rows) / tokens
                den += 1.0
        return num, den
    if mode == "seq-sum-token-sum-norm":
        if norm_length is None:
            raise ValueError("norm_length required")
        return (l * m).sum() / norm_length, B / (B if total_rows is None else total_rows)
    for b in range(B):
        row_sum = (l[b] * m[b]).sum()
        row_len = m[b].sum()
        if mode == "token-mean":
            num += row_sum
            den += row_len * w[b]
        elif mode == "seq-mean-token-mean":
            if row_len > 0:
                num += row_sum / row_len
                den += w[b]
        elif mode == "seq-mean-token-sum":
            num += row_sum
            den += w[b] * (row_len > 0)
        elif mode == "seq-mean-token-sum-norm":
            if norm_length is None:
                raise ValueError("norm_length required")
            num += row_sum / norm_length
            den += w[b] * (row_len > 0)
        else:
            raise ValueError(mode)
    return num, den


def loss_value(num, den):
    return num / den if den > 0 else 0.0


# --------------------------------------------------------------------------------------
# KL, importance weights
# --------------------------------------------------------------------------------------


def kl_penalty(logp, ref_logp, kind="k3", *, clamp=None):
    """[Schulman-KL] per-token estimators of KL(pi || pi_ref) from samples of pi.

    k1 = log pi - log pi_ref;  k2 ("mse") = 0.5 (log pi - log pi_ref)^2;
    k3 [GRPO] eq. (4) = pi_ref/pi - log(pi_ref/pi) - 1 (log-ratio clamped to +-20 [verl]);
    abs = |log pi - log pi_ref|. Optional clamp of the result to [-clamp, clamp] ([verl]: 10).
    """
    d = _f64(logp) - _f64(ref_logp)
    if kind == "k1":
        out = d
    elif kind in ("k2", "mse"):
        out = 0.5 * d * d
    elif kind == "k3":
        x = np.clip(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        out = np.exp(x) - x - 1.0
    elif kind == "abs":
        out = np.abs(d)
    else:
        raise ValueError(kind)
    if clamp is not None:
        out = np.clip(out, -clamp, clamp)
    return out


def exact_kl(p, q):
    """KL(p || q) = sum_x p(x) log(p(x) / q(x)) of two categoricals."""
    p, q = _f64(p), _f64(q)
    return float((p * (np.log(p) - np.log(q))).sum())


def truncated_is_weights(trainer_logp, sampler_logp, cap=2.0):
    """[TIS]: w = min(pi_trainer / pi_sampler, cap) (no gradient)."""
    d = _f64(trainer_logp) - _f64(sampler_logp)
    return np.minimum(np.exp(np.minimum(d, 700.0)), cap)


def _mismatch_d(old_logp, sampler_logp, mask):
    """d = log(pi_old / pi_sampler) on counted tokens, 0 elsewhere; NaN -> 0, +-inf -> +-1e4."""
    d = np.nan_to_num(_f64(old_logp) - _f64(sampler_logp), nan=0.0, posinf=1e4, neginf=-1e4)
    return np.where(_f64(mask) > 0, d, 0.0)


def mismatch_correction(kind, old_logp, sampler_logp, mask, *, advantages=None, cap=None,
                        low=None, high=None, delta=None):
    """(weights [B, T], touched [B, T] bool), written row by row.

    tis_token [TIS]  w_t = min(rho_t, C)                   rho_t = pi_old_t / pi_sampler_t
    tis_seq   [TIS]  w_i = min(prod_t rho_t, C)           on every token of row i
    mis_token [MIS]  w_t = rho_t if rho_t <= C else 0
    mis_seq   [MIS]  w_i = rho_i if rho_i <= C else 0     rho_i = prod_t rho_t
    icepop [IcePop]  w_t = 1 if alpha <= rho_t <= beta else 0
    seq_mask [DSV32] w_i = 0 if A_i < 0 and mean_t (log pi_sampler - log pi_old) > delta else 1
    touched: counted tokens whose weight was truncated (tis) or set to 0 (the others).
    """
    m = _f64(mask)
    d = _mismatch_d(old_logp, sampler_logp, mask)
    B, T = m.shape
    w = np.ones((B, T))
    touched = np.zeros((B, T), bool)
    for b in range(B):
        counted = [t for t in range(T) if m[b, t] > 0]
        row_log = sum(d[b, t] for t in counted)
        for t in range(T):
            if kind == "tis_token":
                rho = math.exp(min(d[b, t], 700.0))
                w[b, t], hit = min(rho, cap), rho > cap
            elif kind == "tis_seq":
                rho = math.exp(min(row_log, 700.0))
                w[b, t], hit = min(rho, cap), rho > cap
            elif kind == "mis_token":
                rho = math.exp(min(d[b, t], 700.0))
                w[b, t], hit = (0.0, True) if rho > cap else (rho, False)
            elif kind == "mis_seq":
                rho = math.exp(min(row_log, 700.0))
                w[b, t], hit = (0.0, True) if rho > cap else (rho, False)
            elif kind == "icepop":
                rho = math.exp(min(d[b, t], 700.0))
                hit = not (low <= rho <= high)
                w[b, t] = 0.0 if hit else 1.0
            elif kind == "seq_mask":
                a = _f64(advantages)
                a_bt = a[b] if a.ndim == 1 else a[b, t]
                div = -row_log / len(counted) if counted else 0.0
                hit = a_bt < 0 and div > delta
                w[b, t] = 0.0 if hit else 1.0
            else:
                raise ValueError(kind)
            touched[b, t] = bool(hit) and m[b, t] > 0
    return w, touched


# --------------------------------------------------------------------------------------
# Filters (DAPO)
# --------------------------------------------------------------------------------------


def overlong_filter_mask(truncated):
    """[DAPO] overlong filtering: truncated samples get loss weight 0."""
    return np.array([0.0 if bool(t) else 1.0 for t in np.asarray(truncated)])


def overlong_soft_penalty(lengths, *, max_length, buffer_length, penalty=1.0):
    """[DAPO] eq. (13), Soft Overlong Punishment, scaled by `penalty`:
        0                                   if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
        -1                                  if L_max < |y|
    """
    out = []
    for L in np.asarray(lengths):
        L = float(L)
        if L <= max_length - buffer_length:
            out.append(0.0)
        elif L <= max_length:
            out.append(((max_length - buffer_length) - L) / buffer_length * penalty)
        else:
            out.append(-penalty)
    return np.array(out)


def constant_group_rows(rewards, group_size):
    """1.0 on rows whose group rewards are all equal."""
    r = _f64(rewards)
    out = np.zeros(r.shape[0])
    for g in range(r.shape[0] // group_size):
        grp = r[g * group_size:(g + 1) * group_size]
        out[g * group_size:(g + 1) * group_size] = float(np.all(grp == grp[0]))
    return out


def dynamic_sampling_mask(rewards, group_size):
    """[DAPO] eq. (11) dynamic sampling: keep groups with 0 < #correct < G, i.e. groups whose
    rewards are not all equal."""
    return 1.0 - constant_group_rows(rewards, group_size)


# --------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------


def compute_advantages(rewards, group_size, recipe, *, truncated=None, lengths=None):
    """Recipe composition (spec): shaped rewards -> advantages over ALL rows -> row weights.

    Shaped rewards = rewards + [DAPO] soft overlong penalty. Advantages use every row (the
    overlong filter only masks the loss). Dynamic sampling keeps groups whose RAW rewards
    (correctness, [DAPO] eq. (11): 0 < #correct < G) are not all equal; exclude_constant_groups
    leaves groups whose SHAPED rewards are all equal (zero advantage) out of the denominators.
    """
    raw = _f64(rewards)
    r = raw.copy()
    B = r.shape[0]
    if recipe.overlong_penalty:
        r = r + overlong_soft_penalty(lengths, max_length=recipe.overlong_max_length,
                                      buffer_length=recipe.overlong_buffer_length,
                                      penalty=recipe.overlong_penalty)
    if recipe.adv_estimator == "normalized":
        valid = dynamic_sampling_mask(raw, group_size) if recipe.dynamic_sampling else None
        adv = normalize_advantages(r, group_size, mean=recipe.adv_mean, std=recipe.adv_std,
                                   eps=recipe.adv_eps, valid=valid)
    elif recipe.adv_estimator == "rloo":
        adv = rloo_advantages(r, group_size)
    else:
        raise NotImplementedError(recipe.adv_estimator)
    row_w = np.ones(B)
    if recipe.overlong_filter:
        row_w = row_w * overlong_filter_mask(truncated)
    if recipe.dynamic_sampling:
        row_w = row_w * dynamic_sampling_mask(raw, group_size)
    den_w = row_w.copy()
    if recipe.exclude_constant_groups:
        den_w = den_w * (1.0 - constant_group_rows(r, group_size))
    if recipe.loss_agg_mode == "prompt-mean-token-mean":
        # [ScaleRL] per-row prompt weight: 1 / (counted tokens of the row's group), kept rows only
        counts = _f64(lengths)
        pw = np.zeros(B)
        for g in range(B // group_size):
            idx = range(g * group_size, (g + 1) * group_size)
            tokens = sum(counts[b] for b in idx if den_w[b] > 0)
            for b in idx:
                pw[b] = 1.0 / tokens if (den_w[b] > 0 and tokens > 0) else 0.0
        den_w = pw
    return dict(advantages=adv, shaped_rewards=r, row_weights=row_w, denominator_weights=den_w)


def policy_loss(recipe, *, logp, old_logp, advantages, mask, row_weights=None,
                denominator_weights=None, ref_logp=None, sampler_logp=None, entropy=None,
                group_size=None):
    """Per-token surrogate (x TIS weight) + kl_coef * KL - entropy_coef * H, aggregated.

    The surrogate is recipe.surrogate: PPO clip, [CISPO] or [SAPO]. For the prompt-level mode
    the 0/1 denominator weights and group_size give the prompts (see aggregate_loss).
    Returns (numerator, denominator) of the scalar loss.
    """
    m = _f64(mask)
    if row_weights is not None:
        m = m * _f64(row_weights)[:, None]
    surrogate = getattr(recipe, "surrogate", "ppo")
    if surrogate == "cispo":
        per_token, _ = cispo_surrogate(logp, old_logp, advantages, m, eps_low=recipe.eps_low,
                                       eps_high=recipe.eps_high, cap_mode=recipe.cispo_cap_mode)
    elif surrogate == "sapo":
        per_token, _ = sapo_surrogate(logp, old_logp, advantages, m, tau_pos=recipe.sapo_tau_pos,
                                      tau_neg=recipe.sapo_tau_neg)
    else:
        per_token, _ = clipped_surrogate(logp, old_logp, advantages, m, eps_low=recipe.eps_low,
                                         eps_high=recipe.eps_high, dual_clip=recipe.dual_clip,
                                         ratio_level=recipe.ratio_level)
    if recipe.tis_cap is not None and sampler_logp is not None:
        per_token = per_token * truncated_is_weights(old_logp, sampler_logp, recipe.tis_cap)
    if getattr(recipe, "is_correction", None) is not None:
        w, touched = mismatch_correction(recipe.is_correction, old_logp, sampler_logp, m,
                                         advantages=advantages, cap=recipe.is_cap, low=recipe.icepop_low,
                                         high=recipe.icepop_high, delta=recipe.seq_mask_delta)
        per_token = per_token * w
    if getattr(recipe, "cov_control", None) == "kl_cov":
        picked = kl_cov_mask(logp, advantages, m, ratio=recipe.cov_ratio)
        per_token = per_token + np.where(picked, recipe.kl_cov_coef * np.abs(_f64(logp) - _f64(old_logp)), 0.0)
    dropped = None
    if getattr(recipe, "is_correction", None) in ("mis_token", "mis_seq", "icepop", "seq_mask"):
        dropped = touched  # masked tokens lose the KL and entropy terms too
    weights = denominator_weights if denominator_weights is not None else row_weights
    # rows outside every denominator (exclude_constant_groups) carry no KL or entropy term
    in_den = 1.0 if weights is None else (_f64(weights) > 0).astype(np.float64)[:, None]
    if recipe.kl_coef > 0:
        per_token = per_token + recipe.kl_coef * in_den * kl_penalty(logp, ref_logp, recipe.kl_kind,
                                                                     clamp=recipe.kl_clamp)
    if recipe.entropy_coef > 0:
        per_token = per_token - recipe.entropy_coef * in_den * _f64(entropy)
    if dropped is not None:
        per_token = np.where(dropped, 0.0, per_token)
    if recipe.loss_agg_mode == "prompt-mean-token-mean":
        weights = (_f64(weights) > 0).astype(np.float64)  # prompt weights -> kept rows
    return aggregate_loss(per_token, m, recipe.loss_agg_mode, norm_length=recipe.norm_length,
                          row_weights=weights, group_size=group_size)


def token_covariance(logp, advantages, mask):
    """[EntropyMech] Cov_t = (logp_t - mean logp)(A_t - mean A), means over counted tokens (mask > 0)."""
    lp = _f64(logp)
    a = _token_advantages(advantages, lp.shape)
    m = _f64(mask) > 0
    n = max(int(m.sum()), 1)
    lp_mean = lp[m].sum() / n
    a_mean = a[m].sum() / n
    return np.where(m, (lp - lp_mean) * (a - a_mean), 0.0)


def selection_count(mask, ratio):
    """max(1, floor(ratio * N)), N the counted tokens."""
    return max(1, int(math.floor(ratio * int((_f64(mask) > 0).sum()))))


def pick_top(scores, eligible, k):
    """The min(k, #eligible) eligible entries of highest score, ties to the lower flat index."""
    s = _f64(scores).reshape(-1)
    e = np.asarray(eligible, bool).reshape(-1)
    ranked = sorted((i for i in range(s.size) if e[i]), key=lambda i: (-s[i], i))
    out = np.zeros(s.size, bool)
    out[ranked[:k]] = True
    return out.reshape(np.shape(scores))


def clip_cov_mask(logp, advantages, mask, uniforms, *, ratio, low, high, exclude=None):
    """[EntropyMech] Clip-Cov: k random counted tokens with low < Cov < high (random = the k
    largest of the given uniforms), never an excluded one."""
    cov = token_covariance(logp, advantages, mask)
    eligible = (_f64(mask) > 0) & (cov > low) & (cov < high)
    if exclude is not None:
        eligible &= ~np.asarray(exclude, bool)
    return pick_top(uniforms, eligible, selection_count(mask, ratio))


def kl_cov_mask(logp, advantages, mask, *, ratio):
    """[EntropyMech] KL-Cov: the k counted tokens of largest covariance."""
    cov = token_covariance(logp, advantages, mask)
    return pick_top(cov, _f64(mask) > 0, selection_count(mask, ratio))


# --------------------------------------------------------------------------------------
# On-policy distillation [OPD]
# --------------------------------------------------------------------------------------


def distill_advantages(row_advantages, student_logp, teacher_logp, mask, *, coef, discount=0.0, clip=None):
    """[OPD] A_t = A_row + sum over counted t' >= t of discount^(t'-t) * c_t', with
    c_t = -coef * (log pi - log pi_T) clipped to [-clip, clip] per token; 0 where uncounted."""
    s, t, m = _f64(student_logp), _f64(teacher_logp), _f64(mask)
    rows, steps = m.shape
    out = np.zeros((rows, steps))
    for b in range(rows):
        term = np.zeros(steps)
        for i in range(steps):
            if m[b, i] > 0:
                c = -coef * (s[b, i] - t[b, i])
                if clip is not None:
                    c = min(max(c, -clip), clip)
                term[i] = c
        for i in range(steps):
            if m[b, i] <= 0:
                continue
            total = term[i]
            if discount > 0:
                for j in range(i + 1, steps):
                    if m[b, j] > 0:
                        total += discount ** (j - i) * term[j]
            row = 0.0 if row_advantages is None else float(row_advantages[b])
            out[b, i] = row + total
    return out


def teacher_kl_metrics(student_logp, teacher_logp, mask, num_bins=10):
    """[OPD] teacher_kl: mean of log pi - log pi_T over all counted tokens (0 if none); by position:
    the j-th counted token (j = 0..n-1) of a row with n counted tokens is in bin floor(num_bins*j/n);
    the mean per bin over the batch (0 for an empty bin) and the token count per bin."""
    s, t, m = _f64(student_logp), _f64(teacher_logp), _f64(mask)
    total, count = 0.0, 0
    bin_sum, bin_count = np.zeros(num_bins), np.zeros(num_bins)
    for b in range(m.shape[0]):
        positions = [i for i in range(m.shape[1]) if m[b, i] > 0]
        n = len(positions)
        for j, i in enumerate(positions):
            d = s[b, i] - t[b, i]
            total += d
            count += 1
            k = (num_bins * j) // n
            bin_sum[k] += d
            bin_count[k] += 1
    by_position = np.array([bin_sum[k] / bin_count[k] if bin_count[k] else 0.0 for k in range(num_bins)])
    return {"teacher_kl": total / count if count else 0.0, "teacher_kl_by_position": by_position,
            "teacher_tokens_by_position": bin_count}


def softmax(logits):
    z = _f64(logits)
    e = np.exp(z - z.max())
    return e / e.sum()


def reverse_kl_logit_grad(logits, q):
    """d/dz KL(p || q) with p = softmax(z): p_j (log p_j - log q_j - KL(p || q))."""
    p, q = softmax(logits), _f64(q)
    return p * (np.log(p) - np.log(q) - exact_kl(p, q))


def forward_kl_logit_grad(logits, q):
    """d/dz KL(q || p) with p = softmax(z): d/dz (-sum_i q_i log p_i) = p - q."""
    return softmax(logits) - _f64(q)
