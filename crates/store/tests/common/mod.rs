//! The store conformance suite: every case runs against PostgreSQL and
//! SQLite (one test binary per backend, so each reports its own count).

#![allow(dead_code)]

pub mod cases;

/// Instantiates every conformance case for one backend.
#[macro_export]
macro_rules! conformance_suite {
    ($backend:expr) => {
        $crate::conformance_suite!($backend;
            migrations_are_idempotent,
            a_schema_newer_than_the_binary_is_refused_by_name,
            automation_round_trips,
            automations_are_scoped_to_their_owner,
            automation_listing_pages_without_gaps,
            stale_version_is_rejected_and_changes_nothing,
            placement_is_immutable_in_the_schema,
            run_creation_is_idempotent_by_id,
            run_transitions_are_guarded,
            terminal_runs_are_final_in_the_schema,
            finish_run_writes_exactly_one_receipt,
            a_run_ends_with_its_receipt_and_status_event_or_not_at_all,
            events_are_ordered_and_deduplicated,
            concurrent_event_appenders_get_contiguous_sequences,
            many_runs_moved_at_once_each_by_its_own_guard,
            runs_are_scoped_and_listed,
            workers_register_once_per_owner,
            runner_tokens_resolve_until_revoked,
            invalid_page_token_is_rejected,
            desktop_assignments_are_claimed_by_one_runner_and_reported_only_by_it,
            text_no_backend_can_store_is_refused_alike_and_never_as_retryable,
            a_runners_newest_stream_holds_its_claims,
            runs_are_leased_to_one_coordinator_and_fenced,
            a_scheduled_run_is_claimed_only_shortly_before_its_instant,
            concurrent_wakes_start_a_worker_once,
            a_worker_with_a_live_run_is_never_stopped,
            an_occurrence_fires_unlocked_only_while_its_guards_hold,
            occurrences_fired_together_each_fire_as_alone,
            many_runs_ended_at_once_each_by_its_own_guard,
            many_reports_and_offers_joined_each_as_alone,
            runs_are_filtered_by_state_and_creation_time,
            a_runner_is_connected_while_its_stream_is_held_and_refreshed,
            crossing_batches_commit_without_deadlock_or_replay,
            cloud_dispatch_is_driven_by_one_replica_and_finished_once,
            executor_seqs_lease_releases_and_terminal_receipts_are_written_once,
            failure_streaks_pause_an_automation_and_a_success_ends_them,
            monthly_budgets_are_read_from_receipts_and_spent_months_listed,
            webhook_endpoints_are_scoped_and_notices_fan_out_once_per_cause,
            webhook_endpoints_are_claimed_once_and_attempts_recorded,
            retention_deletes_finished_runs_past_their_organisations_period,
            retention_drops_a_week_whose_every_run_is_due,
            a_manual_runs_key_names_one_run_whatever_its_id,
        );
    };
    ($backend:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let db = automesh_store::testing::TestDatabase::new($backend)
                    .await
                    .expect("test database (is PostgreSQL running? see README)");
                common::cases::$case(&db.store).await;
                db.remove().await.expect("remove test database");
            }
        )*
    };
}
