from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularSwaggerView

from approvals import api as approvals_api
from execgo import health
from runs.api import errors as api_errors
from runs.api.views import SchemaView
from runs.metrics_view import metrics_view

# Under /api/ Django's own error pages are the API's error envelope.
handler400 = api_errors.bad_request
handler403 = api_errors.permission_denied
handler404 = api_errors.page_not_found
handler500 = api_errors.server_error

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/schema/", SchemaView.as_view(), name="schema"),
    path("api/v1/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/v1/approvals", approvals_api.ApprovalListView.as_view(), name="api-approvals"),
    path("api/v1/approvals/bulk", approvals_api.ApprovalBulkView.as_view(), name="api-approvals-bulk"),
    path("api/v1/approvals/grants", approvals_api.StandingGrantListView.as_view(), name="api-grants"),
    path("api/v1/approvals/grants/<int:grant_id>/revoke", approvals_api.StandingGrantRevokeView.as_view(),
         name="api-grant-revoke"),
    path("api/v1/approvals/<int:request_id>", approvals_api.ApprovalDetailView.as_view(), name="api-approval"),
    path("api/v1/approvals/<int:request_id>/approve", approvals_api.ApprovalDecideView.as_view(),
         name="api-approval-approve"),
    path("api/v1/approvals/<int:request_id>/reject", approvals_api.ApprovalRejectView.as_view(),
         name="api-approval-reject"),
    path("api/v1/", include("runs.api.urls")),
    # Last of the API: any other path under /api/ is a 404 envelope, for every method.
    re_path(r"^api(?:/|$)", api_errors.api_not_found),
    path("approvals/", include("approvals.urls")),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("accounts/login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("pages.urls")),
]
