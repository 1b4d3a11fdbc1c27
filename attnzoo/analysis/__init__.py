"""attnzoo.analysis: measure the papers' claims on attnzoo (or timm) attention layers.

lipschitz     Jacobian spectral norms vs paper 002 Lemmas B.2-B.7 and paper 001 Cor 24
wasserstein   W1/W2 between token clouds (POT), Wasserstein-Lipschitz ratios, paper 001 Thm 29
fields        Gamma_X(x) for every variant through attnzoo.functional (paper 002 sec 2)
particles     token particle dynamics (our own RK4) through attnzoo.functional or kernel sums
kernel_sums   sum_j exp(b_i . y_j) W_j without the n x n matrix (exact blocks / Taylor moments)
gaussian      closed forms and covariance ODEs on Gaussians (paper 002 sec 4)
dynamics      the d = 2 PSD-cone study and limit-rank histograms (paper 002 sec 4.5)
fenchel_dual  ||lambda* - alpha z|| / ||lambda*|| per layer and head (paper 004 Fig 4)
topolip       persistence-diagram change rates across depth (paper 003)
plots         matplotlib figures for all of the above
"""
