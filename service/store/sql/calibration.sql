-- Calibration counters per (provider, model) (service/store/calibration.py; SPEC 5.1): samples,
-- the sum of our estimates, the sum of the provider's prompt tokens.

-- name: load_calibration
SELECT samples, sum_estimate, sum_provider FROM sidequest_calibration
WHERE provider = :provider AND model = :model;

-- name: add_calibration_sample
-- ONE atomic upsert: two workers recording at once never lose an increment.
INSERT INTO sidequest_calibration AS c (provider, model, samples, sum_estimate, sum_provider, updated_at)
VALUES (:provider, :model, 1, :estimate, :reported, now())
ON CONFLICT (provider, model) DO UPDATE SET
    samples = c.samples + 1,
    sum_estimate = c.sum_estimate + EXCLUDED.sum_estimate,
    sum_provider = c.sum_provider + EXCLUDED.sum_provider,
    updated_at = now();
